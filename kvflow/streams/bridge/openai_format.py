"""Pure translation between OpenAI HTTP bodies and kvflow records.

Inbound: a parsed :class:`ChatCompletionRequest`/:class:`CompletionRequest`
becomes an :class:`InferenceRequest` (sampling mapped to
:class:`SamplingParams`). Outbound: :class:`TokenDelta`/:class:`FinalResponse`
records become ``chat.completion``/``text_completion`` objects and their
streamed chunks. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic_core
from pydantic import BaseModel, ValidationError

from kvflow.schemas import (
    ChatMessage,
    FinalResponse,
    InferenceRequest,
    ReplyTo,
    RequestKind,
    SamplingParams,
    Usage,
)
from kvflow.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    KvflowInfo,
    PromptTokensDetails,
    TextPart,
    UsageBody,
)
from kvflow.schemas.media import MEDIA_MARKER, MediaItem
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.streams.bridge.errors import invalid_request, validation_error
from kvflow.streams.deadlines import deadline_ms

__all__ = [
    "ResponseMeta",
    "parse_body",
    "check_supported",
    "chat_messages",
    "sampling_params",
    "to_inference_request",
    "usage_body",
    "kvflow_info",
    "finish_reason",
    "chat_completion",
    "text_completion",
    "chat_role_chunk",
    "chat_text_chunk",
    "chat_finish_chunk",
    "chat_usage_chunk",
    "completion_text_chunk",
    "completion_finish_chunk",
    "completion_usage_chunk",
]

Body = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class ResponseMeta:
    """Fields every object/chunk of one answer repeats.

    ``id`` is the request id (``chatcmpl-…``/``cmpl-…``), ``created`` epoch
    seconds, ``model`` the requested model name.
    """

    id: str
    model: str
    created: int


def parse_body(raw: bytes, schema: type[BaseModel]) -> tuple[Any, dict[str, Any]]:
    """Parse JSON bytes into ``schema``; returns (model, the raw JSON object).

    The parser is strict where Python's ``json`` is lenient: ``NaN`` and
    ``Infinity`` literals, invalid UTF-8, lone surrogate escapes (text no
    tokenizer can encode) and nesting deeper than 200 levels are invalid JSON.

    Raises:
        BridgeError: 400 if the bytes are not a JSON object or fail ``schema``.
    """
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise invalid_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_request("Request body must be a JSON object.", code="invalid_json")
    try:
        return schema.model_validate(data), data
    except ValidationError as exc:
        raise validation_error(exc) from None


_UNSUPPORTED: dict[RequestKind, tuple[tuple[str, str], ...]] = {
    # (field, why) — rejected when present with a value that asks for the feature.
    RequestKind.chat: (("tools", "tool calling"), ("functions", "function calling"),
                       ("logprobs", "logprobs"), ("top_logprobs", "logprobs")),
    RequestKind.completion: (("logprobs", "logprobs"), ("suffix", "suffix"), ("best_of", "best_of > 1")),
}


def check_supported(kind: RequestKind, raw: dict[str, Any]) -> None:
    """Reject features kvflow does not implement instead of silently ignoring them.

    Raises:
        BridgeError: 400 ``unsupported`` naming the field.
    """
    for name, what in _UNSUPPORTED[kind]:
        value = raw.get(name)
        # Falsy values (null, false, 0, [], "") ask for nothing; best_of=1 is the default.
        asks = isinstance(value, (int, float)) and value > 1 if name == "best_of" else bool(value)
        if asks:
            raise invalid_request(f"`{name}` is not supported by kvflow ({what}).", param=name, code="unsupported")
    fmt = raw.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise invalid_request("Only response_format type `text` is supported.", param="response_format",
                              code="unsupported")


def chat_messages(body: ChatCompletionRequest) -> list[ChatMessage]:
    """The request's messages as :class:`ChatMessage` records: text parts
    joined, each media part (``image_url``, ``input_audio``, ``video_url``)
    replaced by :data:`~kvflow.schemas.media.MEDIA_MARKER` where it stands
    (:mod:`kvflow.streams.bridge.media` fills those places).

    Raises:
        BridgeError: 400 when a content part has an unknown type or shape,
            or, in a request with media, text holds the media marker itself.
    """
    parsed = []
    for i, message in enumerate(body.messages):
        try:
            parsed.append(message.parts())
        except ValueError as exc:
            raise invalid_request(f"messages[{i}].{exc}", param=f"messages.{i}.content", code="unsupported") from None
    with_media = any(not isinstance(part, TextPart) for parts in parsed for part in parts)
    out = []
    for i, (message, parts) in enumerate(zip(body.messages, parsed)):
        pieces = []
        for part in parts:
            if not isinstance(part, TextPart):
                pieces.append(MEDIA_MARKER)
                continue
            if with_media and MEDIA_MARKER in part.text:
                raise invalid_request(f"messages[{i}].content: text must not contain U+FFFC (it marks where "
                                      "media parts stand).", param=f"messages.{i}.content", code="invalid_value")
            pieces.append(part.text)
        out.append(ChatMessage(role=message.role, content="".join(pieces)))
    return out


def sampling_params(body: Body, max_tokens: int | None = None) -> SamplingParams:
    """OpenAI sampling fields → :class:`SamplingParams`.

    ``max_tokens`` (output tokens), when given, is the cap the bridge
    settled on (:func:`kvflow.streams.bridge.bounds.output_budget`);
    otherwise ``max_completion_tokens`` (chat) wins over ``max_tokens``, and
    neither given keeps the :class:`SamplingParams` default.
    """
    if max_tokens is None:
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    fields: dict[str, Any] = {
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "stop": body.stop or [], "ignore_eos": body.ignore_eos,
    }
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return SamplingParams(**fields)


def to_inference_request(body: Body, *, request_id: str, reply_to: ReplyTo, token_ids: list[int] | None,
                         created_ms: int, timeout_s: float, messages: list[ChatMessage] | None = None,
                         max_tokens: int | None = None, prompt_embeds: PromptEmbeds | None = None,
                         priority: int | None = None, tenant: str | None = None,
                         session_id: str | None = None, media: list[MediaItem] | None = None) -> InferenceRequest:
    """Build the record the bridge produces for ``body``.

    ``token_ids`` (shape [ISL]) is the pre-tokenized prompt; ``messages`` is
    required for chat bodies (see :func:`chat_messages`). ``deadline_ms`` is
    ``created_ms + timeout_s``: the request is answered by then, and workers
    stop it there (:mod:`kvflow.streams.deadlines`).
    ``max_tokens`` overrides the body's output cap (see :func:`sampling_params`).
    ``prompt_embeds`` (completions) is the whole prompt: ``token_ids`` is then None.
    ``priority``/``session_id`` (see :mod:`kvflow.streams.bridge.serving_class`)
    override the body's; ``tenant`` names the sender. ``media`` (chat) are
    the media items standing at placeholder runs of ``token_ids``.
    """
    common: dict[str, Any] = {
        "request_id": request_id, "model": body.model, "token_ids": token_ids,
        "sampling": sampling_params(body, max_tokens), "reply_to": reply_to, "created_ms": created_ms,
        "deadline_ms": deadline_ms(created_ms, timeout_s),
        "priority": body.priority if priority is None else priority, "tenant": tenant,
        "session_id": body.session_id if session_id is None else session_id,
        "ttft_target_ms": body.ttft_target_ms, "itl_target_ms": body.itl_target_ms,
    }
    if isinstance(body, ChatCompletionRequest):
        if messages is None:
            raise ValueError("chat bodies need their converted messages")
        return InferenceRequest(kind=RequestKind.chat, messages=messages, media=media or None, **common)
    if prompt_embeds is not None:
        return InferenceRequest(kind=RequestKind.completion, prompt_embeds=prompt_embeds, **common)
    prompt = body.prompt if isinstance(body.prompt, str) else None
    return InferenceRequest(kind=RequestKind.completion, prompt=prompt, **common)


def usage_body(usage: Usage) -> UsageBody:
    """kvflow :class:`Usage` → OpenAI ``usage`` (with cached prompt tokens)."""
    return UsageBody(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))


def kvflow_info(final: FinalResponse) -> KvflowInfo:
    """The ``kvflow`` extension field: the routing decision of ``final``."""
    r = final.routing
    if r is None:
        return KvflowInfo(worker_id=final.worker_id)
    return KvflowInfo(worker_id=final.worker_id or r.worker_id, policy=r.policy, overlap_blocks=r.overlap_blocks,
                      cost=r.cost, router_id=r.router_id, prefill_worker_id=r.prefill_worker_id)


def finish_reason(final: FinalResponse) -> str:
    """OpenAI ``finish_reason`` of ``final`` (``stop``, ``length``, or kvflow's ``abort``)."""
    return final.finish_reason.value


def chat_completion(final: FinalResponse, meta: ResponseMeta) -> ChatCompletionResponse:
    """The non-streaming ``chat.completion`` object for ``final``."""
    return ChatCompletionResponse(
        id=meta.id, created=meta.created, model=meta.model,
        choices=[ChatChoice(message=AssistantMessage(content=final.text), finish_reason=finish_reason(final))],
        usage=usage_body(final.usage), kvflow=kvflow_info(final),
    )


def text_completion(final: FinalResponse, meta: ResponseMeta, echo_text: str = "") -> CompletionResponse:
    """The non-streaming ``text_completion`` object; ``echo_text`` is prepended."""
    return CompletionResponse(
        id=meta.id, created=meta.created, model=meta.model,
        choices=[CompletionChoice(text=echo_text + final.text, finish_reason=finish_reason(final))],
        usage=usage_body(final.usage), kvflow=kvflow_info(final),
    )


def chat_role_chunk(meta: ResponseMeta) -> ChatCompletionChunk:
    """First chunk: ``delta.role = assistant`` and empty content."""
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                               choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])


def chat_text_chunk(meta: ResponseMeta, text: str) -> ChatCompletionChunk:
    """A chunk carrying ``text`` as ``delta.content``."""
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                               choices=[ChatChunkChoice(delta=ChatDelta(content=text))])


def chat_finish_chunk(meta: ResponseMeta, final: FinalResponse) -> ChatCompletionChunk:
    """The chunk with ``finish_reason`` (empty delta) and the ``kvflow`` field."""
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                               choices=[ChatChunkChoice(delta=ChatDelta(), finish_reason=finish_reason(final))],
                               kvflow=kvflow_info(final))


def chat_usage_chunk(meta: ResponseMeta, final: FinalResponse) -> ChatCompletionChunk:
    """The ``include_usage`` chunk: empty ``choices``, ``usage`` set."""
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[],
                               usage=usage_body(final.usage))


def completion_text_chunk(meta: ResponseMeta, text: str) -> CompletionResponse:
    """A streamed ``text_completion`` chunk carrying ``text``."""
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                              choices=[CompletionChoice(text=text)])


def completion_finish_chunk(meta: ResponseMeta, final: FinalResponse) -> CompletionResponse:
    """The streamed chunk with ``finish_reason`` and the ``kvflow`` field."""
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                              choices=[CompletionChoice(text="", finish_reason=finish_reason(final))],
                              kvflow=kvflow_info(final))


def completion_usage_chunk(meta: ResponseMeta, final: FinalResponse) -> CompletionResponse:
    """The ``include_usage`` chunk of a streamed completion."""
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[],
                              usage=usage_body(final.usage))
