"""The deadline of an HTTP request: the ``timeout_s`` body field, the
``X-Request-Timeout`` header, or the deployment's default
(:mod:`kvflow.streams.deadlines`, which documents the formula)."""

from __future__ import annotations

import math

from starlette.datastructures import Headers

from kvflow.schemas.openai import ChatCompletionRequest, CompletionRequest
from kvflow.settings import Settings
from kvflow.streams.bridge.errors import invalid_request
from kvflow.streams.deadlines import MAX_TIMEOUT_S, request_timeout_s

__all__ = ["TIMEOUT_HEADER", "timeout_for"]

TIMEOUT_HEADER = "X-Request-Timeout"
"""Request header: seconds from arrival to the request's deadline (a decimal number)."""


def timeout_for(settings: Settings, headers: Headers, body: ChatCompletionRequest | CompletionRequest,
                max_tokens: int) -> float:
    """Seconds from arrival to the deadline of a request of ``max_tokens``
    output tokens: the smaller of ``body.timeout_s`` and the
    :data:`TIMEOUT_HEADER` header when either is given, else the default.

    Raises:
        BridgeError: 400 when the header is not a number in (0, 86400].
    """
    raw = headers.get(TIMEOUT_HEADER)
    header_s = None
    if raw is not None:
        try:
            header_s = float(raw)
        except ValueError:
            header_s = math.nan
        if not 0 < header_s <= MAX_TIMEOUT_S:  # NaN fails too
            raise invalid_request(f"{TIMEOUT_HEADER} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                                  f"not {raw!r}.", param=TIMEOUT_HEADER, code="invalid_value")
    return request_timeout_s(settings, max_tokens, body.timeout_s, header_s)
