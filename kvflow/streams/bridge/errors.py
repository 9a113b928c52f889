"""OpenAI-shaped error answers of the HTTP bridge.

Every non-2xx answer has the body ``{"error": {"message", "type", "param",
"code"}}`` (:class:`kvflow.schemas.openai.ErrorResponse`). Client mistakes
are 4xx with type ``invalid_request_error``; a 5xx means the pipeline or the
bridge failed, never that the input was bad. FastAPI's own 422 validation
answer and Starlette's plain-text 404/405 are replaced by this shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.schemas import ErrorInfo
from kvflow.schemas.openai import ErrorBody, ErrorResponse

__all__ = [
    "BridgeError",
    "invalid_request",
    "context_length_exceeded",
    "invalid_api_key",
    "model_not_found",
    "payload_too_large",
    "no_live_workers",
    "request_timeout",
    "broker_unavailable",
    "from_error_info",
    "validation_error",
    "error_response",
    "install_error_handlers",
]

log = logging.getLogger(__name__)


class BridgeError(Exception):
    """A request the bridge answers with an error instead of a completion.

    ``status`` is the HTTP status; ``type``/``code``/``param`` fill the
    OpenAI error object; ``headers`` are extra response headers (e.g.
    ``Retry-After``). Raised by the request path, turned into a JSON answer
    (or a streamed error event once the stream has started).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """The OpenAI error body of this error."""
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> BridgeError:
    """400: the body is not a valid request (bad JSON, schema, unsupported feature)."""
    return BridgeError(400, message, "invalid_request_error", code=code, param=param)


def context_length_exceeded(message: str, param: str) -> BridgeError:
    """400: prompt plus requested output does not fit the model's context length."""
    return BridgeError(400, message, "invalid_request_error", code="context_length_exceeded", param=param)


def invalid_api_key(message: str) -> BridgeError:
    """401 with ``WWW-Authenticate: Bearer``: no API key, or not a configured one."""
    return BridgeError(401, message, "invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> BridgeError:
    """404: no worker has ever served ``model`` since this bridge started."""
    return BridgeError(404, f"The model `{model}` does not exist or is not served by any worker.",
                       "invalid_request_error", code="model_not_found", param="model")


def payload_too_large(message: str, param: str | None = None) -> BridgeError:
    """413: the prompt has too many tokens, or the body too many bytes."""
    return BridgeError(413, message, "invalid_request_error", code="payload_too_large", param=param)


def no_live_workers(model: str, retry_after_s: float) -> BridgeError:
    """503 with ``Retry-After`` (whole seconds, rounded up): ``model`` has no
    serving worker right now."""
    return BridgeError(503, f"No live worker serves the model `{model}`; retry later.",
                       "service_unavailable", code="no_live_workers",
                       headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def overloaded(retry_after_s: float) -> BridgeError:
    """503 with ``Retry-After``: the bridge serves as many requests as it may."""
    return BridgeError(503, "The server is serving as many requests as it can; retry later.",
                       "service_unavailable", code="overloaded",
                       headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def request_timeout(request_id: str, timeout_s: float) -> BridgeError:
    """504: no response record for ``request_id`` within ``timeout_s`` seconds."""
    return BridgeError(504, f"No response for request {request_id} within {timeout_s:g} s.",
                       "timeout_error", code="request_timeout")


def broker_unavailable(exc: Exception, retry_after_s: float) -> BridgeError:
    """503 with ``Retry-After`` (whole seconds, truncated): sending to or reading
    from Kafka failed with ``exc``."""
    return BridgeError(503, f"The Kafka broker is unavailable: {exc}", "service_unavailable",
                       code="broker_unavailable", headers={"Retry-After": str(int(retry_after_s))})


def from_error_info(info: ErrorInfo) -> BridgeError:
    """The error a worker or router reported on a :class:`FinalResponse`, at
    its own status (a 2xx/1xx status there is treated as 500), with its
    ``param``, and ``Retry-After`` when the router gave one (load shedding)."""
    status = info.status if 400 <= info.status <= 599 else 500
    headers = {"Retry-After": str(max(1, info.retry_after_s))} if info.retry_after_s else None
    return BridgeError(status, info.message, info.type, code=info.code, param=info.param, headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "dict", "list", "any"})


def _field_path(loc: Sequence[Any]) -> list[str]:
    """The field path of a pydantic error location: ``body`` and the type
    tags pydantic adds for union members (``str``, ``list[int]``,
    ``constrained-str``...) left out, list indices kept."""
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            path.append(part)
    return path


def _most_specific(errors: Sequence[Any]) -> Any:
    """The error to report: among those on the first bad field, the deepest.

    A value that fails every member of a union gets one error per member;
    the deepest one is from the member whose shape matched (a list with
    one bad item rather than "not a string").
    """
    field = _field_path(errors[0].get("loc", ()))[:1]
    same = [e for e in errors if _field_path(e.get("loc", ()))[:1] == field]
    return max(same, key=lambda e: len(e.get("loc", ())))


def validation_error(exc: ValidationError | RequestValidationError) -> BridgeError:
    """400 for a pydantic/FastAPI validation failure, naming the first bad field.

    ``param`` is the dotted field path (``messages.0.content``). ``n``
    above 1, where the body allows only 1, gets a message saying multiple
    choices are unsupported rather than pydantic's bare bound message.
    """
    errors = exc.errors()
    if not errors:
        return invalid_request("Invalid request body.")
    first = _most_specific(errors)
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return invalid_request(f"Request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    value = first.get("input")
    one_choice = (first.get("ctx") or {}).get("le") == 1  # a body that takes only n=1 (chat, completions)
    if loc == ["n"] and one_choice and isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return invalid_request("Only n=1 is supported (one choice per request).", param="n", code="unsupported")
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return invalid_request(message, param=param)


def error_response(err: BridgeError) -> JSONResponse:
    """The JSON answer of ``err`` (status, OpenAI body, extra headers)."""
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error answer of ``app`` OpenAI-shaped.

    Handles :class:`BridgeError`, FastAPI's request validation (400 instead
    of 422), Starlette HTTP errors (404 unknown path, 405 method) and, as a
    last resort, any other exception (500 ``server_error``, logged).
    """

    async def on_bridge_error(_: Request, exc: BridgeError) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        return error_response(BridgeError(exc.status_code, str(exc.detail), kind, headers=headers))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(BridgeError(500, "Internal error in the kvflow bridge.", "server_error"))

    app.add_exception_handler(BridgeError, on_bridge_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
