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

Deadlines: a request ends by its ``deadline_ms`` (a request sent without
one gets the default from the moment it is sent, see
:mod:`kvflow.streams.deadlines`); past it the stream ends with a
``deadline_exceeded`` error and a cancel goes to the workers.

Resuming: every stream has a :class:`~kvflow.streams.follow.StreamCursor`
(its partition, the offset of its request's first record, the deltas
delivered); :meth:`KvflowClient.resume` replays the request's records from
the responses topic and continues live from there, on any client
(:mod:`kvflow.streams.resume`).

Slot rotation (embedded broker only): the embedded broker's memory store
lists every stored batch of a partition on each fetch of it, so a slot's
fetches get dearer with every worker flush it ever received
(docs/benchmarks.md, "Live path"). Once the client's slot holds
``settings.response_slot_rotate_records`` records, new requests name the
least-filled other slot instead; the old slot is read until its streams end,
then dropped. ``slot``/``reply_to`` always name the current slot; a request
built for an earlier one of this client's slots is still accepted. A real
Kafka cluster finds an offset through its index, so there the slot never
moves.

The responses reader is supervised: a reader that fails, or that makes no
progress for ``STALL_S`` while its partitions hold unread records, is
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
    EmbeddingRequest,
    EmbeddingResult,
    FinalResponse,
    ImageRequest,
    ImageResult,
    InferenceRequest,
    RecordError,
    ReplyTo,
    ResponseEvent,
    SamplingParams,
    TokenDelta,
    WorkerRole,
    decode,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.deadlines import deadline_ms, default_timeout_s
from kvflow.streams.fetch_wait import produced, wake
from kvflow.streams.follow import MIGRATABLE, Emit, Follower, Resubmit, StreamCursor
from kvflow.streams.kafka import FOLLOW_POLL_MS, DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer
from kvflow.streams.resume import StreamNotFound, Tick, read_request_records
from kvflow.streams.tracing import inject_headers

__all__ = ["KvflowClient", "ResponseStream", "RequestTimeout", "ReaderHealth", "STALL_S", "BUSY_POLL_MS", "MIGRATABLE",
           "StreamCursor", "StreamNotFound", "CANCEL_TIMEOUT_S"]

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 5.0
"""Longest a stream past its deadline waits for the broker to take its cancel
record before answering anyway (the worker also stops at the deadline)."""

SLOT_GRACE_S = 30.0
"""An earlier responses slot is read this long after the client moved off it
(seconds) at least, and until its last stream ends."""

STALL_S = 10.0
"""A responses reader with unread records on its partition and no record
delivered for this long is restarted (seconds). A healthy reader behind by a
few thousand records catches up in well under a second."""

BUSY_POLL_MS = 1000
"""``getmany`` timeout of the responses reader while streams are in flight
(ms): it then notes its progress at least this often. With none in flight it
waits up to :data:`~kvflow.streams.kafka.FOLLOW_POLL_MS` (records end the
wait at once), so an idle client does not wake every second for nothing, or
until an earlier slot it still reads may be dropped."""


@dataclass(frozen=True)
class ReaderHealth:
    """State of a client's responses reader.

    ``lag`` is unread records on the slots read (high watermark − position, from
    the last fetch; 0 when unknown); ``since_progress_s`` the seconds since
    the reader last delivered a record or found nothing to read (0 while it
    waits with nothing to read; with unread records, counted from when the
    client first saw them at the latest);
    ``restarts`` how often the supervisor replaced the reader.
    """

    ok: bool
    lag: int
    since_progress_s: float
    restarts: int


class RequestTimeout(TimeoutError):
    """No response record arrived within the client's timeout."""


class ResponseStream:
    """The response records of one request, as an async iterator
    (:meth:`KvflowClient.stream`, :meth:`KvflowClient.resume`).

    Yields :class:`TokenDelta` records (indices from 0, across migrations)
    then one :class:`FinalResponse`. :attr:`cursor` is where the stream
    stands (None until the request's first record arrived); hand it to
    :meth:`KvflowClient.resume` to go on elsewhere. ``aclose`` stops it.
    """

    def __init__(self, request_id: str, partition: int, *, skip: int = 0) -> None:
        self.request_id = request_id
        self.partition = partition
        self.first_offset: int | None = None
        self.delivered = skip
        self._skip = skip
        self._gen: AsyncIterator[TokenDelta | FinalResponse] | None = None

    def attach(self, gen: AsyncIterator[TokenDelta | FinalResponse]) -> None:
        """Set the generator of the records (done by :class:`KvflowClient`)."""
        self._gen = gen

    def seen(self, offset: int) -> None:
        """A record of the request at ``offset`` was read (the first one fixes the cursor)."""
        if self.first_offset is None:
            self.first_offset = offset

    @property
    def cursor(self) -> StreamCursor | None:
        """Where the stream stands: its partition, the offset of its first
        record and the deltas delivered (None before the first record)."""
        if self.first_offset is None:
            return None
        return StreamCursor(self.request_id, self.partition, self.first_offset, self.delivered)

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __anext__(self) -> TokenDelta | FinalResponse:
        assert self._gen is not None, "ResponseStream used before attach"
        while True:
            event = await self._gen.__anext__()
            if isinstance(event, TokenDelta):
                if event.index < self._skip:
                    continue  # delivered before the resume
                self.delivered = event.index + 1
            return event

    async def aclose(self) -> None:
        """Stop reading (the request goes on; see :meth:`KvflowClient.cancel`)."""
        if self._gen is not None:
            await self._gen.aclose()


class KvflowClient:
    """Produce :class:`InferenceRequest` records and iterate their responses.

    ``slot`` is the responses partition this client's new requests name
    (random if not given; it moves on the embedded broker, see the module
    doc). Two clients sharing a slot still work (each ignores the other's
    request ids) but read each other's traffic, and both dead-letter a
    malformed record there. ``name`` prefixes the first slot in the
    ``consumer`` of this client's dead letters (``bridge`` for the HTTP bridge).
    """

    def __init__(self, settings: Settings, catalog: Catalog | None = None, slot: int | None = None,
                 timeout_s: float | None = None, *, name: str = "client") -> None:
        self.settings = settings
        self.name = name
        self.catalog = catalog or Catalog(settings.namespace)
        self.slot = random.randrange(self.catalog.responses.partitions) if slot is None else slot
        self.timeout_s = timeout_s or settings.request_timeout_s
        self._producer = make_producer(settings)
        self._consumer = make_consumer(settings)
        self._dlq = DeadLetterWriter(self._producer, self.catalog, consumer=f"{name}:{self.slot}")
        self._pending: dict[str, tuple[asyncio.Queue, int]] = {}  # request id -> (its records, the slot they arrive on)
        self._reader: asyncio.Task | None = None
        # Slots read -> first record not yet delivered (None: the end, once the consumer starts).
        self._next_offset: dict[int, int | None] = {self.slot: None}
        self._left_at: dict[int, float] = {}  # earlier slots still read -> when the client moved off them
        self._slots_used = {self.slot}  # every slot this client's requests named
        self._progress = time.monotonic()  # last delivery, or last fetch that found the slots read to their end
        self._waiting = False  # the reader is in a getmany
        self._behind_since: float | None = None  # when unread records were first seen with no delivery since
        self.rotate_records = settings.response_slot_rotate_records if settings.embedded_broker else 0
        self._rotate_at = self.rotate_records  # the current slot's size at which to look for a move
        self.rotations = 0  # slot moves (see the module doc)
        self.reader_restarts = 0
        self.migrations = 0  # requests resubmitted after their worker was lost
        self.deadlines = 0  # streams ended by their request's deadline

    @property
    def slots(self) -> tuple[int, ...]:
        """The responses slots this client reads: its current slot first, then
        earlier ones whose streams have not all ended (see the module doc)."""
        return (self.slot, *(s for s in self._next_offset if s != self.slot))

    @property
    def reply_to(self) -> ReplyTo:
        """Where this client's responses arrive."""
        return ReplyTo(topic=self.catalog.responses.name, partition=self.slot)

    async def start(self) -> None:
        """Connect; responses are read from the current end of the slot on."""
        await self._producer.start()
        await self._start_consumer()
        self._reader = asyncio.create_task(self._supervise(), name="kvflow-client-reader")

    def _tp(self, slot: int) -> TopicPartition:
        return TopicPartition(self.catalog.responses.name, slot)

    async def _start_consumer(self) -> None:
        """Start ``self._consumer`` on the slots read, each at its next offset (None: its end)."""
        await self._consumer.start()
        await self._assign()
        adapt_fetch_wait(self._consumer, self.settings, busy=self._pending.__len__)  # streams in flight: poll fast
        self._progress = time.monotonic()

    async def _assign(self) -> None:
        """Assign the consumer the slots of ``_next_offset`` and position each
        at its next offset (None: its end, which is then recorded)."""
        self._consumer.assign([self._tp(s) for s in self._next_offset])
        for slot, offset in list(self._next_offset.items()):
            if offset is None:
                await self._consumer.seek_to_end(self._tp(slot))
                self._next_offset[slot] = await self._consumer.position(self._tp(slot))
            else:
                self._consumer.seek(self._tp(slot), offset)

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
        since = self._since_progress(lag, time.monotonic())
        alive = self._reader is not None and not self._reader.done()
        return ReaderHealth(ok=alive and not (lag > 0 and since > STALL_S), lag=lag, since_progress_s=since,
                            restarts=self.reader_restarts)

    def _since_progress(self, lag: int, now: float) -> float:
        """Seconds without progress: 0 while the reader waits with nothing to read;
        with ``lag`` unread records, since the last delivery or since unread
        records were first seen here, whichever is later. An idle reader parks in
        long waits, so its last progress can be old when a record lands; counting
        from the sighting keeps that first record from looking like a stall."""
        if lag == 0:
            self._behind_since = None
            return 0.0 if self._waiting else now - self._progress
        if self._behind_since is None:
            self._behind_since = now
        return now - max(self._progress, self._behind_since)

    def _lag(self) -> int:
        lag = 0
        for slot, offset in self._next_offset.items():
            with contextlib.suppress(Exception):  # not assigned yet, or mid-restart
                hw = self._consumer.highwater(self._tp(slot))
                if hw is not None and offset is not None:
                    lag += max(0, hw - offset)
        return lag

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
                    # With no stream waiting, a stall can wait to be noticed: look 10x less often.
                    await asyncio.wait({reader}, timeout=1.0 if self._pending else STALL_S)
                    lag = self._lag()
                    if not reader.done() and lag > 0 and self._since_progress(lag, time.monotonic()) > STALL_S:
                        log.error("responses reader of slots %s stalled %d records behind at offsets %s; restarting",
                                  list(self._next_offset), lag, self._next_offset)
                        reader.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await reader
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    log.error("responses reader of slots %s failed: %r; restarting at offsets %s",
                              list(self._next_offset), reader.exception(), self._next_offset)
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
                await self._start_consumer()
            except Exception:  # noqa: BLE001 - broker unreachable: try again
                log.exception("cannot restart the responses reader of slots %s", list(self._next_offset))

    async def _read_responses(self) -> None:
        while True:
            self._waiting = True
            try:
                batches = await self._consumer.getmany(timeout_ms=self._poll_ms(time.monotonic()))
            finally:
                self._waiting = False
            if not batches and self._lag() == 0:
                self._progress = time.monotonic()
            for tp, records in batches.items():
                if tp.partition not in self._next_offset:
                    continue  # a slot dropped while this fetch was out
                for msg in records:
                    self._next_offset[tp.partition] = msg.offset + 1
                    self._progress = time.monotonic()
                    try:
                        event = decode(ResponseEvent, msg.value)
                    except RecordError as exc:
                        await self._dlq.send(msg, exc)
                        continue
                    key = msg.key.decode("utf-8", "replace") if msg.key else ""
                    stream = self._pending.get(key)
                    if stream is not None and event.request_id == key:
                        stream[0].put_nowait((msg.offset, event))
            if self.rotate_records and await self._rotate():
                await self._assign()

    def _poll_ms(self, now: float) -> int:
        """The reader's ``getmany`` timeout (ms): :data:`BUSY_POLL_MS` while streams are in
        flight; with none, :data:`~kvflow.streams.kafka.FOLLOW_POLL_MS`, cut to when an
        earlier slot's grace ends (:meth:`_rotate` drops it after a fetch), but no shorter
        than :data:`BUSY_POLL_MS`."""
        if self._pending:
            return BUSY_POLL_MS
        if not self._left_at:
            return FOLLOW_POLL_MS
        due_ms = (min(self._left_at.values()) + SLOT_GRACE_S - now) * 1000.0
        return int(min(FOLLOW_POLL_MS, max(BUSY_POLL_MS, due_ms)))

    def _own(self, request: Any) -> tuple[Any, asyncio.Queue]:
        """Register ``request``'s stream (an inference, embedding or image
        request) on the slot it will be answered on; returns the request to
        send and the queue its records arrive in. A request naming an earlier
        slot this client no longer reads is re-addressed to the current one
        (it was built before the client dropped that slot).

        Raises:
            ValueError: ``request.reply_to`` never named one of this client's slots.
        """
        reply_to = request.reply_to
        if reply_to.topic != self.catalog.responses.name or reply_to.partition not in self._slots_used:
            raise ValueError("request.reply_to must be this client's reply_to (use new_request)")
        if reply_to.partition not in self._next_offset:
            request = request.model_copy(update={"reply_to": self.reply_to})
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[request.request_id] = (queue, request.reply_to.partition)
        return request, queue

    def _release(self, request_id: str, queue: asyncio.Queue) -> None:
        """Forget ``request_id``'s stream, unless a newer one reused the id."""
        if self._pending.get(request_id, (None,))[0] is queue:
            del self._pending[request_id]

    async def _rotate(self) -> bool:
        """Drop earlier slots whose streams ended and, when the current one
        is full, move to the least-filled other slot (:meth:`_move`);
        returns whether the slots read changed (the caller reassigns).

        An earlier slot is kept for ``SLOT_GRACE_S`` after the move at least,
        so a request built for it just before the move still finds it read.
        """
        now = time.monotonic()
        busy = {slot for _, slot in self._pending.values()}
        dropped = [slot for slot, left in self._left_at.items() if slot not in busy and now - left > SLOT_GRACE_S]
        for slot in dropped:
            del self._left_at[slot], self._next_offset[slot]
        hw = self._consumer.highwater(self._tp(self.slot))
        moved = hw is not None and hw >= self._rotate_at and await self._move(hw, now)
        return bool(dropped) or moved

    async def _move(self, hw: int, now: float) -> bool:
        """Make the least-filled slot this client does not read its current one, if it holds at
        most half the current slot's ``hw`` records; returns whether it did.
        Where none does, the next look (one ListOffsets request) waits until
        the current slot gained ``rotate_records`` more."""
        others = [self._tp(s) for s in range(self.catalog.responses.partitions) if s not in self._next_offset]
        ends = await self._consumer.end_offsets(others) if others else {}
        self._rotate_at = hw + self.rotate_records
        least = min(ends.values(), default=hw)
        if least * 2 > hw:
            return False
        old, new = self.slot, random.choice([tp.partition for tp, end in ends.items() if end == least])
        self._left_at[old] = now
        self.slot = new
        self._slots_used.add(new)
        self._next_offset[new] = ends[self._tp(new)]
        self._rotate_at = least + self.rotate_records
        self.rotations += 1
        log.info("responses slot %d -> %d (%d records; %d in the new one)", old, new, hw, least)
        return True

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
        """Build a request addressed back to this client (``reply_to`` filled in).

        Without a ``deadline_ms`` field it gets one when sent (:meth:`submit`).
        """
        return InferenceRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
            model=model, messages=messages, prompt=prompt, token_ids=token_ids,
            sampling=sampling or SamplingParams(), reply_to=self.reply_to, created_ms=now_ms(), **fields,
        )

    def with_deadline(self, request: InferenceRequest) -> InferenceRequest:
        """``request``, with the default deadline from now when it has none
        (:func:`kvflow.streams.deadlines.default_timeout_s` of its ``max_tokens``)."""
        if request.deadline_ms is not None:
            return request
        timeout_s = default_timeout_s(self.settings, request.sampling.max_tokens)
        return request.model_copy(update={"deadline_ms": deadline_ms(now_ms(), timeout_s)})

    async def submit(self, request: InferenceRequest, *, key: str | None = None) -> None:
        """Produce ``request`` to the requests topic without waiting for responses.

        ``key`` (default: the request id) picks the requests partition;
        requests sharing a key reach the router in the order sent. A request
        without ``deadline_ms`` is sent with the default one (:meth:`with_deadline`).
        The record carries the current trace context (:mod:`kvflow.streams.tracing`).
        """
        wake(self._consumer)  # its answer will arrive on this client's slot: poll fast
        await self._producer.send_and_wait(self.catalog.requests.name, encode(self.with_deadline(request)),
                                           key=(key or request.request_id).encode(), headers=inject_headers())
        produced(self.catalog.requests.name)  # a router in this process may be parked in a long poll

    async def cancel(self, request_id: str, reason: CancelReason = CancelReason.client_cancelled, *,
                     requested_by: str | None = None) -> None:
        """Ask the workers to abort ``request_id`` (one :class:`CancelRequest`
        on the cancels topic, waiting for the broker's ack).

        The worker holding the request frees its KV blocks and sends a final
        response with ``finish_reason`` ``abort`` (error ``deadline_exceeded``
        for that ``reason``), so a :meth:`stream` of the request still ends
        with a :class:`FinalResponse`. Cancelling an unknown or finished
        request changes nothing. ``requested_by`` defaults to ``<name>:<slot>``.

        Raises:
            pydantic.ValidationError: ``request_id`` is empty or over 256 characters.
            aiokafka.errors.KafkaError: the broker did not take the record.
        """
        record = CancelRequest(request_id=request_id, reason=reason, ts_ms=now_ms(),
                               requested_by=requested_by or f"{self.name}:{self.slot}")
        await self._producer.send_and_wait(self.catalog.cancels.name, encode(record), key=request_id.encode())
        produced(self.catalog.cancels.name)  # the worker running it may be parked in a long poll

    def stream(self, request: InferenceRequest, *, key: str | None = None) -> "ResponseStream":
        """Send ``request`` (partition ``key`` as in :meth:`submit`) and iterate its
        :class:`TokenDelta` records, then its :class:`FinalResponse`; a request
        whose worker is lost continues on another (see the module doc).

        The request ends by its ``deadline_ms`` at the latest: past it the
        stream stops waiting, publishes a cancel (reason
        ``deadline_exceeded``) and ends with a final response of error
        ``deadline_exceeded`` carrying the output delivered so far.
        :attr:`ResponseStream.cursor` says where the stream stands, for :meth:`resume`.

        Raises (while iterating):
            RequestTimeout: nothing arrived for ``timeout_s``.
            ValueError: ``request.reply_to`` never named one of this client's slots.
        """
        handle = ResponseStream(request.request_id, request.reply_to.partition)
        handle.attach(self._live(handle, self.with_deadline(request), key))
        return handle

    def resume(self, request: InferenceRequest, cursor: StreamCursor) -> "ResponseStream":
        """Go on with the stream of ``request`` from ``cursor`` (a
        :attr:`ResponseStream.cursor` of an earlier stream of it, from this or
        any other client): its records are replayed from the responses topic,
        the ``cursor.delivered`` deltas already delivered are skipped, and the
        stream continues live, with the same delta indices and final record
        as the uninterrupted stream. Nothing is sent unless the deadline passes.

        A resumed stream does not resubmit a request whose worker was lost: a
        ``worker_lost``/``worker_stopped`` final is followed by the next
        attempt's records when the stream's earlier reader resubmitted it, and
        otherwise ends the stream (a retryable error).

        Raises (while iterating):
            StreamNotFound: the cursor points at no record of the request.
            RequestTimeout: nothing arrived for ``timeout_s`` once caught up.
            ValueError: ``cursor`` is not a cursor of ``request``.
        """
        if cursor.request_id != request.request_id or cursor.partition != request.reply_to.partition:
            raise ValueError("cursor is not a cursor of this request (request id and reply_to partition)")
        handle = ResponseStream(request.request_id, cursor.partition, skip=cursor.delivered)
        handle.attach(self._replay(handle, self.with_deadline(request), cursor))
        return handle

    async def _live(self, handle: "ResponseStream", request: InferenceRequest,
                    key: str | None) -> AsyncIterator[TokenDelta | FinalResponse]:
        request, queue = self._own(request)
        handle.partition = request.reply_to.partition
        follower = Follower(request, self.settings.max_migrations)
        try:
            await self.submit(request, key=key)
            while True:
                item = await self._next_item(queue, request)
                if item is None:
                    yield await self._expired(follower)
                    return
                offset, event = item
                handle.seen(offset)
                step = follower.feed(event)
                if isinstance(step, Resubmit):
                    self.migrations += 1
                    log.warning("request %s: %s; resubmitting (attempt %d) after %d output tokens",
                                request.request_id, event.error.code, step.request.attempt,
                                len(follower.delivered_ids))
                    await self.submit(step.request, key=key)
                elif step is not None:
                    yield step.event
                    if isinstance(step.event, FinalResponse):
                        return
        finally:
            # The generator may be closed late (an abandoned ``async for``);
            # never drop a newer stream that reused the request id.
            self._release(request.request_id, queue)

    async def _next_item(self, queue: asyncio.Queue, request: InferenceRequest) -> tuple[int, Any] | None:
        """The next ``(offset, record)`` of the request; None once its deadline passed.

        Raises:
            RequestTimeout: nothing arrived for ``timeout_s``.
        """
        if not queue.empty():
            return queue.get_nowait()
        wait_s, deadline = self.timeout_s, False
        if request.deadline_ms is not None:
            left_s = (request.deadline_ms - now_ms()) / 1000
            if left_s <= wait_s:
                wait_s, deadline = max(0.0, left_s), True
        try:
            return await asyncio.wait_for(queue.get(), wait_s)
        except asyncio.TimeoutError:
            if deadline:
                return None
            raise RequestTimeout(f"no response to {request.request_id} within {self.timeout_s} s") from None

    async def _expired(self, follower: Follower) -> FinalResponse:
        """Give up on a request past its deadline: publish its cancel (reason
        ``deadline_exceeded``; a failure is logged, the worker stops at the
        deadline on its own) and return its ``deadline_exceeded`` final."""
        request = follower.request
        self.deadlines += 1
        try:
            await asyncio.wait_for(self.cancel(request.request_id, CancelReason.deadline_exceeded), CANCEL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the answer must not wait on the broker
            log.warning("could not publish the deadline cancel of %s: %r", request.request_id, exc)
        late_ms = now_ms() - (request.deadline_ms or 0)
        return follower.deadline_final(f"Request {request.request_id} did not finish by its deadline "
                                       f"({late_ms} ms ago).")

    async def _replay(self, handle: "ResponseStream", request: InferenceRequest,
                      cursor: StreamCursor) -> AsyncIterator[TokenDelta | FinalResponse]:
        follower = Follower(request, self.settings.max_migrations, migrate=False)
        caught_up, last = False, time.monotonic()
        records = read_request_records(self.settings, self.catalog, cursor)
        async with contextlib.aclosing(records):
            async for item in records:
                if isinstance(item, Tick):
                    caught_up = caught_up or item.caught_up
                    if not caught_up:
                        continue
                    held = follower.release()
                    if held is not None:
                        yield held  # its reader did not resubmit before the replay caught up
                        return
                    if request.deadline_ms is not None and now_ms() >= request.deadline_ms:
                        yield await self._expired(follower)
                        return
                    if time.monotonic() - last > self.timeout_s:
                        raise RequestTimeout(f"no response to {request.request_id} within {self.timeout_s} s")
                    continue
                offset, event = item
                handle.seen(offset)
                last = time.monotonic()
                step = follower.feed(event)
                if caught_up and follower.held is not None:
                    step = Emit(follower.release())  # a live migratable final: nobody else resubmits
                if isinstance(step, Emit):
                    yield step.event
                    if isinstance(step.event, FinalResponse):
                        return
                if caught_up and request.deadline_ms is not None and now_ms() >= request.deadline_ms:
                    yield await self._expired(follower)
                    return

    async def embed(self, request: EmbeddingRequest, partition: int) -> EmbeddingResult:
        """Send an embeddings request to ``queue.embedding[partition]`` (the
        slot of the embedding worker chosen by the caller) and return its
        result (which may carry an ``error``).

        Raises:
            RequestTimeout: no result by the request's ``deadline_ms``, or
                within ``timeout_s`` when it has none.
            ValueError: ``request.reply_to`` never named one of this client's slots.
            aiokafka.errors.KafkaError: the broker did not take the request.
        """
        return await self._call(self.catalog.queue(WorkerRole.embedding).name, partition, request, EmbeddingResult,
                                "embeddings")

    async def generate_image(self, request: ImageRequest, partition: int) -> ImageResult:
        """Send an image request to ``queue.conditioning[partition]`` (the
        slot of the text-stage worker chosen by the caller; the image-stage
        slot is ``request.diffusion_partition``) and return its result
        (which may carry an ``error``).

        Raises:
            RequestTimeout: no result by the request's ``deadline_ms``, or
                within ``timeout_s`` when it has none.
            ValueError: ``request.reply_to`` never named one of this client's slots.
            aiokafka.errors.KafkaError: the broker did not take the request.
        """
        return await self._call(self.catalog.queue(WorkerRole.conditioning).name, partition, request, ImageResult,
                                "images")

    async def _call(self, topic: str, partition: int, request: EmbeddingRequest | ImageRequest,
                    result_type: type, what: str) -> Any:
        """Send ``request`` to ``topic[partition]`` and return the first
        ``result_type`` record answering it on this client's slot."""
        wait_s = self.timeout_s
        if request.deadline_ms is not None:
            wait_s = min(wait_s, max(0.0, (request.deadline_ms - now_ms()) / 1000))
        request, queue = self._own(request)
        try:
            wake(self._consumer)
            await self._producer.send_and_wait(topic, encode(request), key=request.request_id.encode(),
                                               partition=partition)
            produced(topic)
            loop = asyncio.get_running_loop()
            until = loop.time() + wait_s
            while True:
                try:
                    _, event = await asyncio.wait_for(queue.get(), max(0.0, until - loop.time()))
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"no {what} for {request.request_id} within {wait_s:.1f} s") from None
                if isinstance(event, result_type):
                    return event
        finally:
            self._release(request.request_id, queue)

    async def complete(self, request: InferenceRequest) -> FinalResponse:
        """Send ``request`` and return its final response (deltas are skipped)."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, FinalResponse):
                    return event
        raise RequestTimeout(request.request_id)  # pragma: no cover - stream always ends with a final
