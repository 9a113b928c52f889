"""Server-sent events: framing, the record → chunk stream, and the response class.

An OpenAI stream is a sequence of ``data: <json>\\n\\n`` events ending with
``data: [DONE]\\n\\n``. :func:`chat_sse`/:func:`completion_sse` turn the
response records of one request into those events; an error after the
stream started (the status line is already sent) becomes one
``data: {"error": {...}}`` event before ``[DONE]``. :func:`with_ids` gives
every event but ``[DONE]`` an ``id:`` line (:mod:`kvflow.streams.bridge.event_ids`)
and drops the events a resumed client already has.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvflow.schemas import FinalResponse, TokenDelta
from kvflow.streams.bridge.errors import BridgeError, from_error_info
from kvflow.streams.bridge.event_ids import EventId
from kvflow.streams.bridge.openai_format import (
    ResponseMeta,
    chat_finish_chunk,
    chat_role_chunk,
    chat_text_chunk,
    chat_usage_chunk,
    completion_finish_chunk,
    completion_text_chunk,
    completion_usage_chunk,
)

__all__ = ["DONE", "sse_event", "text_events", "chat_sse", "completion_sse", "with_ids", "EventStreamResponse", "SSE_HEADERS"]

DONE = b"data: [DONE]\n\n"
"""The event that ends every OpenAI stream."""

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Headers that keep proxies from buffering the stream."""

Records = AsyncIterator[TokenDelta | FinalResponse]


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One ``data:`` event carrying ``payload`` as compact JSON (UTF-8)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


_MARK = "\x00kvflow-text\x00"


def text_events(text_chunk: Callable[[str], BaseModel]) -> Callable[[str], bytes]:
    """``lambda text: sse_event(text_chunk(text))``, the same bytes, built once
    per stream: the chunk is serialized once around a marker text and each
    event splices the JSON-encoded text in, instead of building and dumping
    three pydantic models per delta on the bridge's event loop. Falls back to
    the plain path if the marker does not occur exactly once."""
    body = text_chunk(_MARK).model_dump_json().encode()
    marker = to_json(_MARK)
    if body.count(marker) != 1:
        return lambda text: sse_event(text_chunk(text))
    head, tail = body.split(marker)
    head, tail = b"data: " + head, tail + b"\n\n"
    return lambda text: head + to_json(text) + tail


async def _final_events(records: Records, text_chunk: Callable[[str], BaseModel],
                        finish: Callable[[FinalResponse], list[BaseModel]]) -> AsyncIterator[bytes]:
    text_event = text_events(text_chunk)
    try:
        async for record in records:
            if isinstance(record, TokenDelta):
                if record.text:  # empty while a multi-byte character is incomplete
                    yield text_event(record.text)
                continue
            if record.error is not None:
                yield sse_event(from_error_info(record.error).body())
            else:
                for chunk in finish(record):
                    yield sse_event(chunk)
            break
    except BridgeError as err:
        yield sse_event(err.body())
    yield DONE


def chat_sse(meta: ResponseMeta, records: Records, include_usage: bool = False) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` events: the role chunk, one chunk per
    non-empty delta text, the ``finish_reason`` chunk (with ``kvflow``), the
    usage chunk if ``include_usage``, then ``[DONE]``.

    ``records`` may raise :class:`BridgeError` (e.g. a timeout); it becomes
    an error event.
    """

    def finish(final: FinalResponse) -> list[BaseModel]:
        chunks: list[BaseModel] = [chat_finish_chunk(meta, final)]
        if include_usage:
            chunks.append(chat_usage_chunk(meta, final))
        return chunks

    async def events() -> AsyncIterator[bytes]:
        yield sse_event(chat_role_chunk(meta))
        async for event in _final_events(records, lambda text: chat_text_chunk(meta, text), finish):
            yield event

    return events()


def completion_sse(meta: ResponseMeta, records: Records, include_usage: bool = False,
                   echo_text: str = "") -> AsyncIterator[bytes]:
    """``text_completion`` chunk events: ``echo_text`` first if given, one
    chunk per non-empty delta text, the ``finish_reason`` chunk (with
    ``kvflow``), the usage chunk if ``include_usage``, then ``[DONE]``."""

    def finish(final: FinalResponse) -> list[BaseModel]:
        chunks: list[BaseModel] = [completion_finish_chunk(meta, final)]
        if include_usage:
            chunks.append(completion_usage_chunk(meta, final))
        return chunks

    async def events() -> AsyncIterator[bytes]:
        if echo_text:
            yield sse_event(completion_text_chunk(meta, echo_text))
        async for event in _final_events(records, lambda text: completion_text_chunk(meta, text), finish):
            yield event

    return events()


async def with_ids(events: AsyncIterator[bytes], first: EventId | None, skip: int = 0) -> AsyncIterator[bytes]:
    """``events`` with an ``id:`` line on each (``first.at(seq)`` for the
    event numbered ``seq`` from 0; none when ``first`` is None) but
    ``[DONE]``, without the first ``skip`` of them (``[DONE]`` is never dropped)."""
    seq = 0
    async for event in events:
        if event == DONE:
            yield event
            continue
        if seq >= skip:
            yield event if first is None else b"id: " + str(first.at(seq)).encode() + b"\n" + event
        seq += 1


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops on client disconnect and
    always runs ``on_close``.

    The body is streamed while ``http.disconnect`` is awaited; whichever ends
    first cancels the other (on every ASGI server version, unlike the
    default that relies on ``send`` failing under ASGI 2.4). :meth:`close`
    stops it from outside (a resumed stream replacing it). ``on_close``
    runs shielded from cancellation after any outcome, even when the body
    iterator never started, so per-request resources are always released.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        self.on_close = on_close
        self._scope: anyio.CancelScope | None = None
        self._closed = False

    def close(self) -> None:
        """End the stream now: the client sees its body end without ``[DONE]``."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = {"start": False, "end": False}

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                if self._closed:
                    tg.cancel_scope.cancel()

                async def stream_then_stop() -> None:
                    await self.stream_response(tracked)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
            if self._closed and sent["start"] and not sent["end"]:
                with contextlib.suppress(Exception):  # the client may be gone as well
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()
