"""The Kafka-native client: put requests on the requests topic, read responses.

No HTTP involved. The client owns one partition ("slot") of the responses
topic, which it names as ``reply_to`` on every request it sends; workers
write that request's token deltas and final response there.
:meth:`KvflowClient.cancel` asks the workers to abort a request (cancels topic).

A response record that fails to decode is sent to the dead-letter topic
(consumer ``<name>:<slot>``) and reading goes on: the reader validates every
record of its slot, whether or not a request of this client waits for it,
so each malformed record is dead-lettered once as long as each slot has one
reader (give every bridge replica and client its own slot).

Migration: when a request's worker is lost (the router answers
``worker_lost``; a worker stopped mid-request answers ``worker_stopped``),
:meth:`KvflowClient.stream` resubmits it, up to ``settings.max_migrations``
times, with the output delivered so far appended to its prompt, and goes on
yielding one stream: delta indices continue, the final record carries the
whole text and usage. Records of an earlier attempt (a worker thought lost
that still answers) are dropped. Needs the request's ``token_ids`` (the
bridge always sends them); a stop string spanning the migration point is
not detected.

The responses reader is supervised: a reader that fails, or that makes no
progress for ``STALL_S`` while its partition holds unread records, is
replaced by a new consumer positioned at the first record not yet delivered,
so no response is skipped or delivered twice; :meth:`KvflowClient.health`
says whether the reader is keeping up (the bridge's ``/health`` uses it).

Example::

    async with KvflowClient(Settings(bootstrap_servers="127.0.0.1:9092")) as c:
        req = c.new_request("SmolLM2-135M-Instruct", messages=[ChatMessage(role="user", content="Hi")])
        final = await c.complete(req)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from kvflow.schemas import (
    CancelReason,
    CancelRequest,
    ChatMessage,
    FinalResponse,
    InferenceRequest,
    RecordError,
    ReplyTo,
    ResponseEvent,
    SamplingParams,
    TokenDelta,
    decode,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced, wake
from kvflow.streams.kafka import DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer

__all__ = ["KvflowClient", "RequestTimeout", "ReaderHealth", "STALL_S", "MIGRATABLE"]

MIGRATABLE = frozenset({"worker_lost", "worker_stopped"})
"""Error codes of a final record after which a request is resubmitted elsewhere."""

log = logging.getLogger(__name__)

STALL_S = 10.0
"""A responses reader with unread records on its partition and no record
delivered for this long is restarted (seconds). A healthy reader behind by a
few thousand records catches up in well under a second."""


@dataclass(frozen=True)
class ReaderHealth:
    """State of a client's responses reader.

    ``lag`` is unread records on the slot (high watermark − position, from
    the last fetch; 0 when unknown); ``since_progress_s`` the seconds since
    the reader last delivered a record or found nothing to read;
    ``restarts`` how often the supervisor replaced the reader.
    """

    ok: bool
    lag: int
    since_progress_s: float
    restarts: int


class RequestTimeout(TimeoutError):
    """No final response arrived within the client's timeout."""


class KvflowClient:
    """Produce :class:`InferenceRequest` records and iterate their responses.

    ``slot`` is the responses partition this client reads (random if not
    given). Two clients sharing a slot still work (each ignores the other's
    request ids) but read each other's traffic, and both dead-letter a
    malformed record there. ``name`` prefixes the slot in the ``consumer``
    of this client's dead letters (``bridge`` for the HTTP bridge).
    """

    def __init__(self, settings: Settings, catalog: Catalog | None = None, slot: int | None = None,
                 timeout_s: float | None = None, *, name: str = "client") -> None:
        self.settings = settings
        self.catalog = catalog or Catalog(settings.namespace)
        self.slot = random.randrange(self.catalog.responses.partitions) if slot is None else slot
        self.timeout_s = timeout_s or settings.request_timeout_s
        self._producer = make_producer(settings)
        self._consumer = make_consumer(settings)
        self._dlq = DeadLetterWriter(self._producer, self.catalog, consumer=f"{name}:{self.slot}")
        self._pending: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._tp = TopicPartition(self.catalog.responses.name, self.slot)
        self._next_offset: int | None = None  # first record not yet delivered
        self._progress = time.monotonic()  # last delivery, or last fetch that found the slot read to its end
        self.reader_restarts = 0
        self.migrations = 0  # requests resubmitted after their worker was lost

    @property
    def reply_to(self) -> ReplyTo:
        """Where this client's responses arrive."""
        return ReplyTo(topic=self.catalog.responses.name, partition=self.slot)

    async def start(self) -> None:
        """Connect; responses are read from the current end of the slot on."""
        await self._producer.start()
        await self._start_consumer(None)
        self._reader = asyncio.create_task(self._supervise(), name="kvflow-client-reader")

    async def _start_consumer(self, offset: int | None) -> None:
        """Start ``self._consumer`` on the slot at ``offset`` (None: its end)."""
        await self._consumer.start()
        self._consumer.assign([self._tp])
        if offset is None:
            await self._consumer.seek_to_end(self._tp)
        else:
            self._consumer.seek(self._tp, offset)
        self._next_offset = await self._consumer.position(self._tp)
        adapt_fetch_wait(self._consumer, self.settings)
        self._progress = time.monotonic()

    async def stop(self) -> None:
        """Stop reading; pending streams end with :class:`RequestTimeout`."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._consumer.stop()
        await self._producer.stop()

    def health(self) -> ReaderHealth:
        """Whether the responses reader is alive and keeping up (see :class:`ReaderHealth`)."""
        lag = self._lag()
        since = time.monotonic() - self._progress
        alive = self._reader is not None and not self._reader.done()
        return ReaderHealth(ok=alive and not (lag > 0 and since > STALL_S), lag=lag, since_progress_s=since,
                            restarts=self.reader_restarts)

    def _lag(self) -> int:
        with contextlib.suppress(Exception):  # not assigned yet, or mid-restart
            hw = self._consumer.highwater(self._tp)
            if hw is not None and self._next_offset is not None:
                return max(0, hw - self._next_offset)
        return 0

    async def __aenter__(self) -> "KvflowClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _supervise(self) -> None:
        """Run the reader; replace it (new consumer at the first undelivered
        record) when it fails or stalls."""
        while True:
            reader = asyncio.create_task(self._read_responses(), name="kvflow-client-responses")
            try:
                while not reader.done():
                    await asyncio.wait({reader}, timeout=1.0)
                    if not reader.done() and self._lag() > 0 and time.monotonic() - self._progress > STALL_S:
                        log.error("responses reader of slot %d stalled %d records behind at offset %s; restarting",
                                  self.slot, self._lag(), self._next_offset)
                        reader.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await reader
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    log.error("responses reader of slot %d failed: %r; restarting at offset %s",
                              self.slot, reader.exception(), self._next_offset)
            finally:
                if not reader.done():
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reader
            self.reader_restarts += 1
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            await asyncio.sleep(0.2)
            self._consumer = make_consumer(self.settings)
            try:
                await self._start_consumer(self._next_offset)
            except Exception:  # noqa: BLE001 - broker unreachable: try again
                log.exception("cannot restart the responses reader of slot %d", self.slot)

    async def _read_responses(self) -> None:
        while True:
            batches = await self._consumer.getmany(self._tp, timeout_ms=1000)
            if not batches and self._lag() == 0:
                self._progress = time.monotonic()
            for records in batches.values():
                for msg in records:
                    self._next_offset = msg.offset + 1
                    self._progress = time.monotonic()
                    try:
                        event = decode(ResponseEvent, msg.value)
                    except RecordError as exc:
                        await self._dlq.send(msg, exc)
                        continue
                    key = msg.key.decode("utf-8", "replace") if msg.key else ""
                    queue = self._pending.get(key)
                    if queue is not None and event.request_id == key:
                        queue.put_nowait(event)

    def new_request(
        self,
        model: str,
        *,
        messages: list[ChatMessage] | None = None,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> InferenceRequest:
        """Build a request addressed back to this client (``reply_to`` filled in)."""
        return InferenceRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
            model=model, messages=messages, prompt=prompt, token_ids=token_ids,
            sampling=sampling or SamplingParams(), reply_to=self.reply_to, created_ms=now_ms(), **fields,
        )

    async def submit(self, request: InferenceRequest, *, key: str | None = None) -> None:
        """Produce ``request`` to the requests topic without waiting for responses.

        ``key`` (default: the request id) picks the requests partition;
        requests sharing a key reach the router in the order sent.
        """
        wake(self._consumer)  # its answer will arrive on this client's slot: poll fast
        await self._producer.send_and_wait(self.catalog.requests.name, encode(request),
                                           key=(key or request.request_id).encode())
        produced(self.catalog.requests.name)  # a router in this process may be parked in a long poll

    async def cancel(self, request_id: str, reason: CancelReason = CancelReason.client_cancelled, *,
                     requested_by: str | None = None) -> None:
        """Ask the workers to abort ``request_id`` (one :class:`CancelRequest`
        on the cancels topic, waiting for the broker's ack).

        The worker holding the request frees its KV blocks and sends a final
        response with ``finish_reason`` ``abort``, so a :meth:`stream` of the
        request still ends with a :class:`FinalResponse`. Cancelling an unknown
        or finished request changes nothing. ``requested_by`` defaults to
        ``client:<slot>``.

        Raises:
            pydantic.ValidationError: ``request_id`` is empty or over 256 characters.
            aiokafka.errors.KafkaError: the broker did not take the record.
        """
        record = CancelRequest(request_id=request_id, reason=reason, ts_ms=now_ms(),
                               requested_by=requested_by or f"client:{self.slot}")
        await self._producer.send_and_wait(self.catalog.cancels.name, encode(record), key=request_id.encode())

    async def stream(self, request: InferenceRequest, *, key: str | None = None,
                     ) -> AsyncIterator[TokenDelta | FinalResponse]:
        """Send ``request`` (partition ``key`` as in :meth:`submit`) and yield its
        :class:`TokenDelta` records, then its :class:`FinalResponse`; a request
        whose worker is lost continues on another (see the module doc).

        Raises:
            RequestTimeout: nothing arrived for ``timeout_s``.
            ValueError: ``request.reply_to`` is not this client's slot.
        """
        if request.reply_to != self.reply_to:
            raise ValueError("request.reply_to must be this client's reply_to (use new_request)")
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[request.request_id] = queue
        current = request
        delivered_ids: list[int] = []  # output ids yielded so far, all attempts
        delivered_text: list[str] = []
        prior = 0  # of those, the ones produced before the current attempt
        index = 0
        try:
            await self.submit(request, key=key)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"no response to {request.request_id} within {self.timeout_s} s") from None
                if event.attempt != current.attempt:
                    continue  # an earlier attempt's worker still answering
                if isinstance(event, TokenDelta):
                    delivered_ids.extend(event.token_ids)
                    delivered_text.append(event.text)
                    if event.index != index:
                        event = event.model_copy(update={"index": index})
                    index += 1
                    yield event
                    continue
                nxt = self._continuation(request, current, event, delivered_ids)
                if nxt is not None:
                    self.migrations += 1
                    log.warning("request %s: %s; resubmitting (attempt %d) after %d output tokens",
                                request.request_id, event.error.code, nxt.attempt, len(delivered_ids))
                    current, prior = nxt, len(delivered_ids)
                    await self.submit(nxt, key=key)
                    continue
                if current.attempt and event.error is None:
                    event = self._merged_final(request, event, delivered_ids[:prior], "".join(delivered_text))
                yield event
                return
        finally:
            # The generator may be closed late (an abandoned ``async for``);
            # never drop a newer stream that reused the request id.
            if self._pending.get(request.request_id) is queue:
                del self._pending[request.request_id]

    def _continuation(self, original: InferenceRequest, current: InferenceRequest, final: FinalResponse,
                      delivered: list[int]) -> InferenceRequest | None:
        """The resubmission of ``original`` after ``final`` (None: pass ``final`` on)."""
        if (final.error is None or final.error.code not in MIGRATABLE or original.token_ids is None
                or current.attempt >= self.settings.max_migrations):
            return None
        left = original.sampling.max_tokens - len(delivered)
        if left <= 0:
            return None
        return original.model_copy(update={
            "token_ids": [*original.token_ids, *delivered], "attempt": current.attempt + 1,
            "resumed_tokens": original.resumed_tokens + len(delivered),
            "sampling": original.sampling.model_copy(update={"max_tokens": left}), "routing": None,
        })

    @staticmethod
    def _merged_final(original: InferenceRequest, final: FinalResponse, prior_ids: list[int],
                      text: str) -> FinalResponse:
        """The final record of a migrated request as one uninterrupted request's:
        ``prior_ids`` (output of the earlier attempts) then the final's ids,
        the whole ``text``, the original prompt length."""
        usage = final.usage.model_copy(update={
            "prompt_tokens": len(original.token_ids or ()),
            "completion_tokens": len(prior_ids) + final.usage.completion_tokens})
        return final.model_copy(update={"token_ids": [*prior_ids, *final.token_ids], "text": text, "usage": usage})

    async def complete(self, request: InferenceRequest) -> FinalResponse:
        """Send ``request`` and return its final response (deltas are skipped)."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, FinalResponse):
                    return event
        raise RequestTimeout(request.request_id)  # pragma: no cover - stream always ends with a final
