"""Limits on a request that depend on the deployment, checked after tokenizing.

Static bounds (ranges, counts, string lengths) are part of the request body
schemas (:mod:`kvflow.schemas.openai`). What is left needs the prompt's
token count and the serving workers: the configured most output tokens
(``Settings.max_output_tokens``) and the model's context length, which
workers advertise on their heartbeats (``WorkerHeartbeat.context_length``).
When no worker advertises one, only the configured limits apply.
"""

from __future__ import annotations

from kvflow.schemas import SamplingParams
from kvflow.schemas.openai import ChatCompletionRequest, CompletionRequest
from kvflow.streams.bridge.errors import context_length_exceeded, invalid_request

__all__ = ["DEFAULT_MAX_TOKENS", "requested_max_tokens", "output_budget"]

DEFAULT_MAX_TOKENS: int = SamplingParams.model_fields["max_tokens"].default
"""Output tokens of a request that names no ``max_tokens`` (before clamping to the context)."""


def requested_max_tokens(body: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    """The output-token cap the client asked for and the field that carried it.

    ``max_completion_tokens`` (chat) wins over ``max_tokens``. Returns
    ``(None, "max_tokens")`` when neither was given.
    """
    completion = getattr(body, "max_completion_tokens", None)
    if completion is not None:
        return completion, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def output_budget(body: ChatCompletionRequest | CompletionRequest, prompt_tokens: int, *,
                  max_output_tokens: int, context_length: int | None, prompt_param: str) -> int:
    """The ``max_tokens`` to put on the request record, in output tokens.

    A requested cap must be at most ``max_output_tokens`` and, when the
    model's ``context_length`` (tokens) is known, fit beside the
    ``prompt_tokens``-long prompt. Without a requested cap the default
    (:data:`DEFAULT_MAX_TOKENS`) is lowered to whatever room is left.
    ``prompt_param`` names the prompt field in errors (``prompt`` or
    ``messages``).

    Raises:
        BridgeError: 400 ``invalid_value`` for a cap above
            ``max_output_tokens``; 400 ``context_length_exceeded`` when the
            prompt fills the context, or prompt plus cap exceeds it.
    """
    requested, param = requested_max_tokens(body)
    if requested is not None and requested > max_output_tokens:
        raise invalid_request(f"{param} is too large: {requested}. This deployment allows at most "
                              f"{max_output_tokens} output tokens per request.", param=param, code="invalid_value")
    room = None if context_length is None else context_length - prompt_tokens
    if room is not None and room < 1:
        raise context_length_exceeded(
            f"This model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} "
            "tokens, leaving no room for output.", param=prompt_param)
    if requested is None:
        return min(DEFAULT_MAX_TOKENS, max_output_tokens, room if room is not None else DEFAULT_MAX_TOKENS)
    if room is not None and requested > room:
        raise context_length_exceeded(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the completion). "
            f"Lower {param} to at most {room}.", param=param)
    return requested
