"""The request path of ``/v1/responses``, mapped onto the chat path.

Steps: read the body (size limit) → parse and validate
(:class:`~kvflow.schemas.openai_responses.ResponsesRequest`; tools and
non-text formats are 400 ``unsupported``) → look up ``previous_response_id``
in the responses log (404 when it is not stored) → build the conversation:
``instructions`` as a system message, the stored conversation, then
``input`` → the same steps as ``/v1/chat/completions`` from there
(:func:`~kvflow.streams.bridge.pipeline.prepare_parsed`: model check,
chat template, bounds, deadline, the request record, whose id is the
response id) → wait for the final record (or the first, streaming) →
store the conversation with its answer (unless ``store`` is false) →
answer one ``response`` object, or the stream of typed events.

Errors before the first record are HTTP errors; after a stream started, a
``response.failed`` event ends it. A client gone before the final record
gets its request cancelled upstream, as on the chat path (streams of this
endpoint are not resumable, so there is no grace period).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from aiokafka.errors import KafkaError
from fastapi import Request, Response
from pydantic import ValidationError

from kvflow.schemas import ChatMessage, FinalResponse, FinishReason, StoredResponse, TokenDelta
from kvflow.schemas.openai import ChatCompletionRequest
from kvflow.schemas.openai_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
)
from kvflow.streams.bridge.body import read_body
from kvflow.streams.bridge.disconnect import ClientDisconnected, cancel_upstream, unless_disconnected
from kvflow.streams.bridge.errors import (
    BridgeError,
    error_response,
    from_error_info,
    invalid_request,
    overloaded,
    validation_error,
)
from kvflow.streams.bridge.metrics import STATUS_CLIENT_CLOSED, RequestObserver
from kvflow.streams.bridge.openai_format import parse_body
from kvflow.streams.bridge.pipeline import Prepared, next_record, prepare_parsed
from kvflow.streams.bridge.sse import EventStreamResponse
from kvflow.streams.bridge.state import BridgeState, admit, release

__all__ = ["ENDPOINT", "serve_responses", "conversation", "response_object"]

log = logging.getLogger(__name__)

ENDPOINT = "responses"
"""Endpoint label of ``/v1/responses`` (Prometheus ``endpoint``)."""

# Chat-path parameter names → their names in a Responses API body.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}

Events = AsyncIterator[TokenDelta | FinalResponse]


def _check_supported(body: ResponsesRequest, raw: dict) -> None:
    """Raises BridgeError 400 ``unsupported`` for tools and non-text output formats."""
    if body.tools:
        raise invalid_request("`tools` is not supported by kvflow (tool calling).", param="tools", code="unsupported")
    fmt = raw.get("text", {}).get("format") if isinstance(raw.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise invalid_request("Only text.format type `text` is supported.", param="text.format", code="unsupported")


def conversation(body: ResponsesRequest, previous: StoredResponse | None) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """``(history, prompt)``: the conversation to store (chained history
    then ``input``) and the messages to send (the same, after
    ``instructions`` as a system message)."""
    items = ([ChatMessage(role="user", content=body.input)] if isinstance(body.input, str)
             else [ChatMessage(role=m.role, content=m.text()) for m in body.input])
    history = [*(previous.messages if previous is not None else ()), *items]
    head = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    return history, head + history


def _chat_body(body: ResponsesRequest, prompt: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat body the request is served as.

    Raises:
        BridgeError: 400 when the mapped body fails validation.
    """
    try:
        return ChatCompletionRequest(
            model=body.model, messages=[m.model_dump() for m in prompt], max_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, stream=body.stream, user=body.user,
            timeout_s=body.timeout_s)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _renamed(err: BridgeError) -> BridgeError:
    err.param = _PARAMS.get(err.param or "", err.param)
    return err


def _message(item_id: str, text: str, status: str) -> OutputMessage:
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])  # type: ignore[arg-type]


def response_object(body: ResponsesRequest, response_id: str, created_ms: int, *,
                    final: FinalResponse | None = None, error: BridgeError | None = None) -> ResponseObject:
    """The ``response`` object: in progress (no ``final``), finished from
    ``final`` (``completed``; ``incomplete`` when cut by the output cap or
    cancelled), or ``failed`` with ``error``."""
    common = dict(id=response_id, created_at=created_ms // 1000, model=body.model, instructions=body.instructions,
                  previous_response_id=body.previous_response_id, max_output_tokens=body.max_output_tokens,
                  temperature=body.temperature, top_p=body.top_p, store=body.store, metadata=body.metadata or {},
                  user=body.user)
    if error is not None:
        return ResponseObject(**common, status="failed", error=ResponseError(code=error.code or error.type,
                                                                            message=error.message))
    if final is None:
        return ResponseObject(**common, status="in_progress")
    incomplete = None
    if final.finish_reason is FinishReason.length:
        incomplete = IncompleteDetails(reason="max_output_tokens")
    elif final.finish_reason is FinishReason.abort:
        incomplete = IncompleteDetails(reason="cancelled")
    status = "completed" if incomplete is None else "incomplete"
    usage = final.usage
    return ResponseObject(
        **common, status=status, incomplete_details=incomplete,
        output=[_message(_item_id(response_id), final.text, status)],
        usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                            total_tokens=usage.total_tokens,
                            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens)))


def _item_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


async def _store(state: BridgeState, body: ResponsesRequest, response_id: str, created_ms: int,
                 history: list[ChatMessage], final: FinalResponse) -> None:
    """Log the conversation with its answer (a failure is logged: the answer still goes out)."""
    if not body.store or state.responses_log is None:
        return
    entry = StoredResponse(response_id=response_id, model=body.model, created_ms=created_ms,
                           messages=[*history, ChatMessage(role="assistant", content=final.text)])
    try:
        await state.responses_log.store(entry)
    except KafkaError as exc:
        log.warning("could not store response %s: %r", response_id, exc)


def _event_bytes(event: ResponseStreamEvent) -> bytes:
    return b"event: " + event.type.encode() + b"\ndata: " + event.model_dump_json().encode() + b"\n\n"


async def _events(state: BridgeState, body: ResponsesRequest, p: Prepared, history: list[ChatMessage],
                  first: TokenDelta | FinalResponse, events: Events, observer: RequestObserver) -> AsyncIterator[bytes]:
    """The typed events of one streamed response (see :mod:`kvflow.schemas.openai_responses`)."""
    rid, created = p.request.request_id, p.request.created_ms
    item_id = _item_id(rid)
    seq = iter(range(1 << 62))

    def event(type_: str, **members) -> bytes:
        return _event_bytes(ResponseStreamEvent(type=type_, sequence_number=next(seq), **members))

    at = {"output_index": 0, "item_id": item_id, "content_index": 0}
    started = response_object(body, rid, created)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    yield event("response.output_item.added", output_index=0, item=_message(item_id, "", "in_progress").model_copy(
        update={"content": []}))
    yield event("response.content_part.added", **at, part=OutputText(text=""))
    record, text = first, []
    try:
        while True:
            if isinstance(record, FinalResponse):
                break
            if record.text:
                text.append(record.text)
                yield event("response.output_text.delta", **at, delta=record.text, logprobs=[])
            record = await next_record(events, state, rid)
            observer.on_event(record)
    except BridgeError as err:
        observer.finish(err.status, err.code)
        yield event("response.failed", response=response_object(body, rid, created, error=err))
        return
    if record.error is not None:
        err = from_error_info(record.error)
        observer.finish(err.status, err.code)
        yield event("response.failed", response=response_object(body, rid, created, error=err))
        return
    await _store(state, body, rid, created, history, record)
    done = response_object(body, rid, created, final=record)
    full = done.output[0]
    yield event("response.output_text.done", **at, text=record.text, logprobs=[])
    yield event("response.content_part.done", **at, part=full.content[0])
    yield event("response.output_item.done", output_index=0, item=full)
    yield event("response.completed" if done.status == "completed" else "response.incomplete", response=done)
    observer.finish(200)


async def _close(*gens) -> None:
    for gen in gens:
        with contextlib.suppress(Exception):
            await gen.aclose()


async def _answer(state: BridgeState, http_request: Request, observer: RequestObserver) -> Response:
    raw = await read_body(http_request, state.max_body_bytes)
    body, data = parse_body(raw, ResponsesRequest)
    _check_supported(body, data)
    previous = None
    if body.previous_response_id is not None:
        previous = await state.responses_log.get(body.previous_response_id) if state.responses_log else None
        if previous is None:
            raise BridgeError(404, f"Previous response with id `{body.previous_response_id}` not found.",
                              "invalid_request_error", code="previous_response_not_found",
                              param="previous_response_id")
    history, prompt = conversation(body, previous)
    response_id = "resp_" + uuid.uuid4().hex
    try:
        p = await prepare_parsed(state, http_request, _chat_body(body, prompt), prompt, request_id=response_id)
    except BridgeError as err:
        raise _renamed(err) from None
    observer.submitted(response_id, body.model, len(p.request.token_ids or ()))
    events = state.source.stream(p.request)
    try:
        record = await unless_disconnected(http_request, next_record(events, state, response_id))
        observer.on_event(record)
        while not body.stream and not isinstance(record, FinalResponse):
            record = await unless_disconnected(http_request, next_record(events, state, response_id))
            observer.on_event(record)
    except ClientDisconnected:
        await _close(events)
        await cancel_upstream(state.cancel, state.metrics, ENDPOINT, response_id)
        raise
    except BaseException:
        await _close(events)
        raise
    if isinstance(record, FinalResponse):
        await _close(events)
        if record.error is not None:
            raise from_error_info(record.error)
    if not body.stream:
        assert isinstance(record, FinalResponse)
        await _store(state, body, response_id, p.request.created_ms, history, record)
        observer.finish(200)
        obj = response_object(body, response_id, p.request.created_ms, final=record)
        return Response(obj.model_dump_json(), media_type="application/json", headers={"X-Request-Id": response_id})
    stream = _events(state, body, p, history, record, events, observer)

    async def on_close() -> None:
        await _close(stream, events)
        if observer.final is None:  # the client left before the final record
            observer.finish(STATUS_CLIENT_CLOSED)
            await cancel_upstream(state.cancel, state.metrics, ENDPOINT, response_id)

    return EventStreamResponse(stream, on_close, headers={"X-Request-Id": response_id})


async def serve_responses(state: BridgeState, http_request: Request) -> Response:
    """Answer one Responses API request: a ``response`` object, an SSE stream
    of typed events, or an OpenAI error.

    Never raises for client mistakes; unexpected exceptions propagate to the
    app's last-resort handler (500).
    """
    if not admit(state):
        RequestObserver(state.metrics, ENDPOINT).finish(503, "overloaded")
        return error_response(overloaded(1.0))
    observer = RequestObserver(state.metrics, ENDPOINT, state.publish_metrics, on_finish=lambda: release(state))
    try:
        return await _answer(state, http_request, observer)
    except ClientDisconnected:
        observer.finish(STATUS_CLIENT_CLOSED)
        return Response(status_code=STATUS_CLIENT_CLOSED)
    except BridgeError as err:
        observer.finish(err.status, err.code)
        return error_response(err)
    except BaseException:
        observer.finish(500)
        raise
