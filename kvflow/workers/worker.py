"""The worker process: consume one queue partition, run an engine, stream results.

Data flow: ``queue.<role>[slot]`` → :class:`~kvflow.workers.engines.base.Engine`
→ token deltas and a final response to each request's ``reply_to``. Side
streams: heartbeats (workers topic), KV events (kv-events topic), load
snapshots (metrics topic). The worker assigns its partition directly (no
consumer group, so no rebalance pauses) and commits its position under the
group ``<namespace>.worker.<role>.<slot>`` so a replacement on the same slot
resumes where it left off.

Delivery: a queue record's offset is committed once its request has been
handed to the engine, so a crash loses at most the requests in flight
(at-most-once); a drain loses none (see :meth:`Worker.drain`).

Cancellation: the worker reads the whole cancels topic (every worker does;
see :class:`~kvflow.streams.catalog.Catalog`). A cancel for a request it
holds aborts it in the engine (KV blocks freed) and the request ends with a
final response whose ``finish_reason`` is ``abort``; a cancel for an id it
does not hold is remembered for a while (:data:`CANCELS_REMEMBERED`), so a
request that reaches this worker after its cancel (a cancel overtaking the
router, or a disaggregated request forwarded from its prefill worker) is
answered with ``abort`` at once; a worker starting up reads back the most
recent cancels for the same reason (its queue may already hold requests
cancelled before it started). A malformed cancel is skipped (counted in
``malformed_cancels``); the router dead-letters it, once for the deployment.
Malformed KV dump requests, also read whole by every worker, are skipped
and dead-lettered by the router the same way. A malformed record on the
worker's own queue slot is dead-lettered by the worker (it alone reads it).

Deadlines: a request with a ``deadline_ms`` is ended at that time if it is
still held (a timer aborts it in the engine, as a cancel would) and its
final response carries the error ``deadline_exceeded`` (HTTP 504) with the
output generated so far; a cancel record of reason ``deadline_exceeded``
(sent by a client that gave up at the deadline) ends it the same way.
Either is counted in ``expired``, not ``aborted``.

Disaggregated serving: a record whose ``disaggregated_params`` holds a stage
(:mod:`kvflow.schemas.transfer`) takes the prefill or decode path of
:mod:`kvflow.workers.disagg`; every other record is served aggregated. The
worker owns one :class:`~kvflow.workers.kv.transfer.KvTransport`, created
on first use (at start for prefill and decode workers whose engine has real
KV), and a draining worker waits for its exposed KV to be pulled.

Engine admin: the worker also reads the whole control topic (from its end)
and applies the sleep, wake and clear-KV commands naming it
(:mod:`kvflow.workers.admin`); while asleep it heartbeats ``sleeping`` and
takes nothing from its queue. On an engine that serves LoRA adapters
(:class:`~kvflow.workers.engines.capabilities.ServesLora`) it applies
``load_lora``/``unload_lora``/``list_lora`` through an
:class:`~kvflow.workers.lora.AdapterManager`, lists the loaded adapters in
its heartbeats, and loads an adapter on demand for a request naming one it
lacks when a ``load_lora`` command for any worker told it the URI.

Observability: each request is served under a ``worker serve`` span (child
of the router's, from the queue record's ``traceparent`` header) with an
``engine generate`` child (:mod:`kvflow.streams.tracing`); the worker's
Prometheus series (:mod:`kvflow.workers.prometheus`) are served on
``settings.metrics_port`` when it is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from opentelemetry import trace

from kvflow.schemas import (
    AdminAction,
    AdminCommand,
    CancelReason,
    CancelRequest,
    ControlRecord,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    KvDumpRequest,
    KvEvent,
    KvEventBatch,
    RecordError,
    RequestAdmitted,
    RequestFinished,
    Timings,
    TokenDelta,
    Usage,
    WorkerHeartbeat,
    WorkerMetrics,
    WorkerRole,
    WorkerStatus,
    deadline_exceeded,
    decode,
    encode,
    now_ms,
)
from kvflow.schemas.transfer import DecodeStage, KvTransferInfo, PrefillStage, parse_stage
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import FOLLOW_POLL_MS, DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer
from kvflow.streams.tracing import extract_context, inject_headers, tracer
from kvflow.workers import admin, disagg
from kvflow.workers.engines.base import Engine, EngineError, EngineOutput, GenerateRequest
from kvflow.workers.engines.capabilities import DumpsKvEvents, ExposesKvLayout, HasTokenizer, ServesLora
from kvflow.workers.heartbeat_clock import idle_beat_due, next_idle_beat_tick, next_tick, tick_time, wait_for_tick
from kvflow.workers.kv.transfer import KvTransport, TransferConfig
from kvflow.workers.lora import AdapterError, AdapterManager
from kvflow.workers.prometheus import WorkerExporter
from kvflow.workers.stops import StopChecker

__all__ = ["WorkerConfig", "Worker", "CANCELS_REMEMBERED", "flush_tick"]

log = logging.getLogger(__name__)

CANCELS_REMEMBERED = 4096
"""Cancels of requests not (yet) held that a worker remembers, oldest dropped
first. Every worker keeps every such cancel of the deployment; at 100
cancels/s this covers the last ~40 s, far longer than a request takes to
reach its worker (milliseconds), at ~100 bytes each."""

CATCH_UP_TIMEOUT_S = 10.0
"""Longest a starting worker spends reading back recent cancels before it
takes work (4096 records take milliseconds; the bound is for a broker that
stalls)."""


_ticks = itertools.count()


def flush_tick(period_s: float, now: float | None = None) -> int:
    """Index of the current tick of the worker-wide delta flush clock.

    The clock ticks every ``period_s`` seconds of ``now`` (default
    ``time.monotonic()``); a stream's buffered tokens go out at its first
    engine output in a later tick than the one its buffer started in. With
    ``period_s`` 0 every call is a new tick (a delta per engine output).
    """
    if period_s <= 0:
        return next(_ticks)
    return int((time.monotonic() if now is None else now) // period_s)


@dataclass
class WorkerConfig:
    """Identity and limits of one worker.

    ``slot`` is the queue partition it consumes; ``model`` the served model
    name; ``tokenizer`` the spec producers use to pre-tokenize for it;
    ``max_inflight`` caps requests taken from the queue and not finished;
    ``drain_timeout_s`` bounds how long a drain waits for in-flight requests;
    ``metrics_interval_s`` is the period of :class:`WorkerMetrics` snapshots;
    ``pool`` the worker pool it joins (``""``: the default pool);
    ``lora_cache_dir`` where remote LoRA adapters are fetched to (``""``:
    ``kvflow-lora`` under the system temporary directory).
    """

    worker_id: str
    slot: int
    model: str
    tokenizer: str = "bytes"
    role: WorkerRole = WorkerRole.aggregated
    max_inflight: int = 256
    drain_timeout_s: float = 60.0
    metrics_interval_s: float = 2.0
    pool: str = ""
    lora_cache_dir: str = ""


@dataclass
class _Inflight:
    request: InferenceRequest
    task: asyncio.Task
    received_ms: int
    cancel: CancelRequest | None = None  # set once a cancel for this request arrived


class Worker:
    """Adapts an :class:`Engine` to Kafka. ``await run()`` until drained or stopped."""

    def __init__(self, settings: Settings, config: WorkerConfig, engine: Engine, catalog: Catalog | None = None) -> None:
        self.settings = settings
        self.config = config
        self.engine = engine
        self.catalog = catalog or Catalog(settings.namespace)
        self.queue_tp = TopicPartition(self.catalog.queue(config.role).name, config.slot)
        # Control topics, read whole by every worker (assigned, no group): dump requests, admin commands, cancels.
        self.control_tps = [TopicPartition(self.catalog.kv_dump_requests.name, 0),
                            TopicPartition(self.catalog.control.name, 0),
                            *(TopicPartition(self.catalog.cancels.name, p) for p in range(self.catalog.cancels.partitions))]
        if config.slot >= self.catalog.queue(config.role).partitions:
            raise ValueError(f"slot {config.slot} >= {self.catalog.queue(config.role).partitions} queue partitions")
        self.producer = make_producer(settings)
        self.consumer = make_consumer(
            settings, group_id=f"{settings.namespace}.worker.{config.role.value}.{config.slot}",
            enable_auto_commit=False,
        )
        self.dlq = DeadLetterWriter(self.producer, self.catalog, consumer=config.worker_id)
        self.inflight: dict[str, _Inflight] = {}
        self.status = WorkerStatus.serving
        self.started_ms = now_ms()
        self.next_event_id = 0
        self.lifecycle_seq = 0  # seq of the next record on the inflight topic
        self.kv_pending: list[KvEvent] = []
        self.kv_wakeup = asyncio.Event()
        self.served = 0
        self.aborted = 0  # requests ended because of a cancel record
        self.expired = 0  # requests ended by their deadline (timer or deadline cancel)
        self.malformed_cancels = 0  # cancel records that failed validation (skipped)
        self.skipped_foreign = 0  # queue records routed to a predecessor on this slot (skipped)
        self._finish_published: set[str] = set()  # finish record sent before the final response
        self._aborted_reported = 0  # self.aborted at the last metrics snapshot
        # Cancels of requests not held here, by request id (at most CANCELS_REMEMBERED).
        self.early_cancels: OrderedDict[str, CancelRequest] = OrderedDict()
        self._stop = asyncio.Event()
        self._heartbeat_wake = asyncio.Event()  # work arrived or a beat went out: a parked heartbeat loop resumes
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()  # deadline cancels in progress
        self._last_tokens = (time.monotonic(), 0, 0)
        self._transport: KvTransport | None = None
        self._transport_lock = asyncio.Lock()
        self.queue_paused = False  # asleep (admin): take nothing from the queue
        self.admin_lock = asyncio.Lock()  # one admin command at a time
        self._admin_tasks: set[asyncio.Task] = set()
        self.adapters: AdapterManager | None = None  # LoRA adapters, on engines that serve them
        if isinstance(engine, ServesLora):
            cache = config.lora_cache_dir or os.path.join(tempfile.gettempdir(), "kvflow-lora")
            self.adapters = AdapterManager(engine.load_lora, engine.unload_lora, Path(cache))
        # Adapter URIs by name from every load_lora command read on the control topic (any worker's):
        # a request routed here for an adapter not loaded loads it from there.
        self.adapter_uris: dict[str, str] = {}
        self.prom = WorkerExporter(self)
        self.metrics_server = None  # kvflow.streams.metrics_server.MetricsServer while serving /metrics

    # lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start engine and clients, position on the queue, register."""
        self.engine.kv_event_sink = self._on_kv_events
        await self.engine.start()
        await self.producer.start()
        await self.consumer.start()
        # One consumer for the queue slot and the control topics: on the embedded broker each
        # consumer costs a fetch per poll, idle or busy. Only queue records make it poll fast.
        self.consumer.assign([self.queue_tp, *self.control_tps])
        committed = await self.consumer.committed(self.queue_tp)
        if committed is None:
            await self.consumer.seek_to_end(self.queue_tp)
        await self.consumer.position(self.queue_tp)
        # Rung: every writer of its queue and control topics (routers, forwarding workers, clients
        # sending cancels, admin) rings this process, so it parks between requests even while it
        # serves some instead of polling every fetch_max_wait_ms (~25 fetches/s per worker).
        adapt_fetch_wait(self.consumer, self.settings, self.queue_tp.topic.__eq__, rung=True)
        await self._position_control()
        if self.config.role is not WorkerRole.aggregated and isinstance(self.engine, ExposesKvLayout):
            await self.kv_transport()  # pick and log the KV transfer backend before taking work
        await self._heartbeat()
        if self.settings.metrics_port is not None:
            from kvflow.streams.metrics_server import serve_metrics

            self.metrics_server = await serve_metrics([self.prom.registry], self.settings.metrics_host,
                                                      self.settings.metrics_port)
            log.info("worker %s metrics at %s", self.config.worker_id, self.metrics_server.url)
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._kv_publisher(), name="kv-events"),
            asyncio.create_task(self._control_listener(), name="control"),
        ]
        log.info("worker %s serving %s on %s[%d]", self.config.worker_id, self.config.model, *self.queue_tp)

    async def _position_control(self) -> None:
        """Position on the control topics (assigned, no group: every worker reads them whole).

        Dump requests are read from their current end: older ones asked a
        worker that has since gone. Cancels are read back from up to
        :data:`CANCELS_REMEMBERED` records before their end (split evenly over
        the partitions) before the worker takes work, so a request already
        waiting in this slot's queue when the worker starts (a restart, or a
        slot taken over) is answered ``abort`` without reaching the engine if
        its cancel came earlier. Offsets, not timestamps, place the rewind:
        Tansu answers ``offsets_for_times`` with offset 0.
        """
        dumps, admin_tp, *cancels = self.control_tps
        for tp in (dumps, admin_tp):  # commands sent before this worker existed were not for it
            await self.consumer.seek_to_end(tp)
            await self.consumer.position(tp)
        per_partition = max(1, CANCELS_REMEMBERED // len(cancels))
        ends = await self.consumer.end_offsets(cancels)
        starts = await self.consumer.beginning_offsets(cancels)
        for tp in cancels:
            self.consumer.seek(tp, max(starts[tp], ends[tp] - per_partition))
        # Read them before taking work, so a cancelled backlog request never reaches the engine.
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        behind = [tp for tp in cancels if await self.consumer.position(tp) < ends[tp]]
        while behind and time.monotonic() < deadline:
            await self._apply_control(await self.consumer.getmany(*behind, timeout_ms=200))
            behind = [tp for tp in behind if await self.consumer.position(tp) < ends[tp]]

    async def run(self) -> None:
        """Start, consume until :meth:`drain` or :meth:`stop`, then shut down."""
        await self.start()
        try:
            await self._consume_loop()
        finally:
            await self._shutdown()

    async def drain(self) -> None:
        """Stop taking work without losing any.

        1. Publish a ``draining`` heartbeat: routers stop sending here.
        2. Keep consuming for two heartbeat periods, so requests routed before
           the routers saw step 1 are still served.
        3. Wait (up to ``drain_timeout_s``) for in-flight requests to finish.
        4. :meth:`run` then publishes ``stopped`` and exits.

        A sleeping worker holds no request and is routed none: it stops at once
        (records still in its queue stay there for the next worker on the slot).
        """
        if self.status is WorkerStatus.sleeping:
            self.status = WorkerStatus.draining
            self._stop.set()
            return
        if self.status != WorkerStatus.serving:
            return
        self.status = WorkerStatus.draining
        await self._heartbeat()
        await asyncio.sleep(2 * self.settings.heartbeat_interval_ms / 1000)
        self._stop.set()

    def stop(self) -> None:
        """Stop now (in-flight requests are aborted with an error response)."""
        self._stop.set()

    async def _shutdown(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.inflight and time.monotonic() < deadline and self.status == WorkerStatus.draining:
            await asyncio.sleep(0.05)
        for item in list(self.inflight.values()):
            item.task.cancel()
        await asyncio.gather(*(i.task for i in self.inflight.values()), return_exceptions=True)
        while (self._transport is not None and self._transport.num_exposed and time.monotonic() < deadline
               and self.status == WorkerStatus.draining):
            await asyncio.sleep(0.05)  # decode workers are still pulling KV prefilled here
        self.status = WorkerStatus.stopped
        with contextlib.suppress(Exception):
            await self._heartbeat()
        for task in (*self._tasks, *self._admin_tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._admin_tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._flush_kv_events()
        await self.engine.stop()
        if self._transport is not None:
            await self._transport.close()
        await self.consumer.stop()
        await self.producer.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        log.info("worker %s stopped after %d requests", self.config.worker_id, self.served)

    # request path ------------------------------------------------------------

    async def _consume_loop(self) -> None:
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                room = self.config.max_inflight - len(self.inflight)
                if room <= 0 or self.queue_paused:
                    await asyncio.sleep(0.005)
                    continue
                # Records end the wait at once, and so does a stop: an idle worker does not wake
                # every second to look (each empty getmany is a wake-up and some CPU).
                fetch = asyncio.ensure_future(
                    self.consumer.getmany(self.queue_tp, timeout_ms=FOLLOW_POLL_MS, max_records=room))
                await asyncio.wait((fetch, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()  # records not yet returned stay unconsumed for the slot's next worker
                    await asyncio.gather(fetch, return_exceptions=True)
                    if not fetch.cancelled() and fetch.exception() is None:
                        await self._take(fetch.result())
                    break
                await self._take(fetch.result())
        finally:
            stopped.cancel()

    async def _take(self, batches: dict[TopicPartition, list[Any]]) -> None:
        """Start serving the queue records of one ``getmany``, then commit past them."""
        records = batches.get(self.queue_tp, [])
        for msg in records:
            request = await self.dlq.decode(InferenceRequest, msg)
            if request is None:
                continue
            if request.request_id in self.inflight:
                continue  # duplicate delivery of a request already being served
            if self._routed_elsewhere(request):
                self.skipped_foreign += 1  # its router answers it worker_lost; the client resubmits
                continue
            early = self.early_cancels.pop(request.request_id, None)
            if early is not None:
                self._count_cancel(early)  # its cancel overtook it; _serve answers it at once
            task = asyncio.create_task(self._serve(request, extract_context(msg.headers)),
                                       name=f"req-{request.request_id}")
            self.inflight[request.request_id] = _Inflight(request, task, now_ms(), cancel=early)
            self._heartbeat_wake.set()
        if records:
            await self.consumer.commit({self.queue_tp: records[-1].offset + 1})

    def _routed_elsewhere(self, request: InferenceRequest) -> bool:
        """Whether ``request`` was routed to another worker on this slot (a
        predecessor that crashed): serving it too would answer it twice,
        since the router answers a lost worker's requests ``worker_lost``
        and the client resubmits them."""
        routing = request.routing
        if routing is None:
            return False
        target = routing.prefill_worker_id if self.config.role is WorkerRole.prefill else routing.worker_id
        return bool(target) and target != self.config.worker_id

    async def _send(self, request: InferenceRequest, record: Any) -> None:
        if request.attempt and getattr(record, "attempt", request.attempt) != request.attempt:
            record = record.model_copy(update={"attempt": request.attempt})
        await self.producer.send(request.reply_to.topic, encode(record), key=request.request_id.encode(),
                                 partition=request.reply_to.partition)

    async def send_to(self, topic: str, partition: int, key: bytes, record: Any) -> None:
        """Produce ``record`` to ``topic[partition]`` (waits for the broker's ack,
        so a forwarded request is durable before this worker lets go of it),
        with the current trace context in its headers."""
        await self.producer.send_and_wait(topic, encode(record), key=key, partition=partition,
                                          headers=inject_headers())
        produced(topic, partition)  # its worker may be parked in a long poll

    async def kv_transport(self) -> KvTransport:
        """This worker's KV transport, started on first use (NIXL or TCP, see
        :class:`~kvflow.workers.kv.transfer.KvTransport`).

        Raises:
            kvflow.workers.kv.transfer.TransferError: the configured backend
                (``nixl`` only) could not start.
        """
        async with self._transport_lock:
            if self._transport is None:
                transport = KvTransport(self.config.worker_id, TransferConfig.from_settings(self.settings))
                await transport.start()
                self._transport = transport
        return self._transport

    async def _serve(self, request: InferenceRequest, parent: Any = None) -> None:
        """Serve one request under a ``worker serve`` span, child of ``parent``
        (the trace context of its queue record; None: a new trace)."""
        with tracer().start_as_current_span("worker serve", context=parent, kind=trace.SpanKind.CONSUMER) as span:
            span.set_attribute("kvflow.request_id", request.request_id)
            span.set_attribute("kvflow.worker_id", self.config.worker_id)
            await self._serve_traced(request)

    async def _serve_traced(self, request: InferenceRequest) -> None:
        received = now_ms()
        timer = self._deadline_timer(request)
        try:
            await self._publish_admitted(request)
            if self.is_cancelled(request.request_id):
                await disagg.release_unpulled(self, request)
                await self.answer_aborted(request, received)
                return
            await self._generate(request, received)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.engine.abort(request.request_id)
                await self._send(request, self._error(request, "worker stopped before the request finished", 503,
                                                      "worker_stopped"))
            raise
        except EngineError as exc:
            if self.is_cancelled(request.request_id):  # e.g. a prefill ended by the cancel's engine abort
                await self.answer_aborted(request, received)
            else:
                await self._send(request, self._error(request, str(exc), 400, "engine_rejected"))
        except Exception as exc:  # noqa: BLE001 - report, never let one request kill the worker
            log.exception("request %s failed", request.request_id)
            await self._send(request, self._error(request, f"internal error: {exc!r}", 500, "worker_error"))
        finally:
            if timer is not None:
                timer.cancel()
            cancelled = self.is_cancelled(request.request_id)
            self.inflight.pop(request.request_id, None)
            self.served += 1
            if request.request_id not in self._finish_published:
                await self._publish_finished(request, cancelled)
            self._finish_published.discard(request.request_id)

    def _deadline_timer(self, request: InferenceRequest) -> asyncio.TimerHandle | None:
        """A timer that ends ``request`` at its ``deadline_ms`` (None: it has none).
        One already past is answered by :meth:`_generate` without the engine."""
        if request.deadline_ms is None:
            return None
        record = self._deadline_cancel(request)
        loop = asyncio.get_running_loop()
        delay_s = max(0.0, (request.deadline_ms - now_ms()) / 1000)
        return loop.call_later(delay_s, lambda: self._spawn(self.cancel(record)))

    def _deadline_cancel(self, request: InferenceRequest) -> CancelRequest:
        return CancelRequest(request_id=request.request_id, reason=CancelReason.deadline_exceeded,
                             requested_by=self.config.worker_id, ts_ms=max(0, request.deadline_ms or 0))

    def _spawn(self, coro: Any) -> None:
        # Keep a reference: the loop holds tasks weakly.
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _publish_admitted(self, request: InferenceRequest) -> None:
        """Tell the routers this worker holds ``request`` (:class:`RequestAdmitted` on the
        inflight topic; see :mod:`kvflow.router.inflight`). ``prefill_tokens``: the prompt
        less the routing decision's cached overlap; the whole prompt for a remote prefill;
        0 for a decode stage. ``max_tokens``: the request's output cap; 0 for a remote
        prefill (its decode worker decodes it). Raises nothing but cancellation: a lost
        record is reconciled by the next heartbeat."""
        seq, self.lifecycle_seq = self.lifecycle_seq, self.lifecycle_seq + 1
        prompt = len(request.token_ids) if request.token_ids else 0
        try:
            stage = parse_stage(request.disaggregated_params)
        except ValueError:
            stage = None  # _generate answers the malformed stage
        decoded = request.sampling.max_tokens
        if isinstance(stage, DecodeStage):
            prefill = 0
        elif isinstance(stage, PrefillStage) or request.routing is None:
            prefill = prompt
            if isinstance(stage, PrefillStage):
                decoded = 0  # the decode worker decodes it
        else:
            prefill = max(0, prompt - request.routing.overlap_blocks * self.engine.block_size)
        await self._publish_lifecycle(RequestAdmitted(
            worker_id=self.config.worker_id, started_ms=self.started_ms, seq=seq, request_id=request.request_id,
            prompt_tokens=prompt, prefill_tokens=prefill, max_tokens=decoded, ts_ms=now_ms()))

    async def _publish_finished(self, request: InferenceRequest, cancelled: bool) -> None:
        """Tell the routers ``request`` ended here (:class:`RequestFinished`), after
        publishing the KV events still pending, so a router folds the cache the
        request left before it learns the worker is free. Raises nothing but
        cancellation."""
        seq, self.lifecycle_seq = self.lifecycle_seq, self.lifecycle_seq + 1
        try:
            await self._flush_kv_events()
        except Exception:  # noqa: BLE001 - the finish record must still go out
            log.exception("publishing KV events failed")
        await self._publish_lifecycle(RequestFinished(
            worker_id=self.config.worker_id, started_ms=self.started_ms, seq=seq, request_id=request.request_id,
            cancelled=cancelled, kv_event_id=self.next_event_id, ts_ms=now_ms()))

    async def _publish_lifecycle(self, record: RequestAdmitted | RequestFinished) -> None:
        try:
            await self.producer.send(self.catalog.inflight.name, encode(record), key=self.config.worker_id.encode())
        except Exception:  # noqa: BLE001 - routers fall back to heartbeats
            log.exception("publishing %s of %s failed", record.type, record.request_id)

    async def answer_aborted(self, request: InferenceRequest, received_ms: int) -> None:
        """Send ``request``'s client the final ``abort`` response of a request
        that produced no tokens here (cancelled before or right after its
        prefill); a ``deadline_exceeded`` error when its deadline ended it."""
        await self._send(request, self._aborted(request, received_ms))

    def _aborted(self, request: InferenceRequest, received_ms: int) -> FinalResponse:
        expired = self._expired(request.request_id)
        return FinalResponse(request_id=request.request_id,
                             finish_reason=FinishReason.error if expired else FinishReason.abort,
                             error=self._deadline_error(request) if expired else None,
                             worker_id=self.config.worker_id, routing=request.routing,
                             timings=Timings(queued_ms=received_ms, finished_ms=now_ms()))

    def is_cancelled(self, request_id: str) -> bool:
        """Whether a cancel arrived for ``request_id`` while this worker holds it."""
        item = self.inflight.get(request_id)
        return item is not None and item.cancel is not None

    async def cancel(self, record: CancelRequest) -> bool:
        """Apply one cancel record: abort ``record.request_id`` if this worker holds it.

        A held request (waiting or running in the engine, or not yet handed
        to it) is aborted in the engine, which frees its KV blocks; its
        stream then ends with a final response of ``finish_reason`` ``abort``
        (:meth:`stream_outputs`, or :meth:`_serve` before the engine has it).
        Returns True when it aborted a held request; False when the request
        is not held here (the cancel is remembered, see
        :data:`CANCELS_REMEMBERED`) or was already cancelled.
        """
        rid = record.request_id
        item = self.inflight.get(rid)
        if item is None:
            self.early_cancels[rid] = record
            self.early_cancels.move_to_end(rid)
            while len(self.early_cancels) > CANCELS_REMEMBERED:
                self.early_cancels.popitem(last=False)
            return False
        if item.cancel is not None:
            return False
        item.cancel = record
        self._count_cancel(record)
        log.info("aborting %s: %s by %s", rid, record.reason.value, record.requested_by)
        # A no-op if the engine has not seen the request yet; the flag set
        # above then ends it at its first output (stream_outputs) or before it starts (_serve).
        await self.engine.abort(rid)
        return True

    def _count_cancel(self, record: CancelRequest) -> None:
        if record.reason is CancelReason.deadline_exceeded:
            self.expired += 1
        else:
            self.aborted += 1

    def _expired(self, request_id: str) -> bool:
        """Whether ``request_id`` is held here and was ended by its deadline."""
        item = self.inflight.get(request_id)
        return item is not None and item.cancel is not None and item.cancel.reason is CancelReason.deadline_exceeded

    def _deadline_error(self, request: InferenceRequest) -> ErrorInfo:
        return deadline_exceeded(f"request {request.request_id} passed its deadline on worker {self.config.worker_id}")

    def _error(self, request: InferenceRequest, message: str, status: int, code: str) -> FinalResponse:
        return FinalResponse(
            request_id=request.request_id, finish_reason=FinishReason.error, worker_id=self.config.worker_id,
            routing=request.routing,
            error=ErrorInfo(message=message, type="invalid_request_error" if status < 500 else "server_error",
                            code=code, status=status),
        )

    def prompt_ids(self, request: InferenceRequest) -> list[int]:
        """The request's prompt token ids (shape [ISL]): ``token_ids`` when the
        producer tokenized, else the engine's tokenizer applied to the messages
        or prompt; for prompt embeddings, their row ids."""
        if request.prompt_embeds is not None:
            return request.prompt_embeds.row_ids()  # keys its KV blocks; the embeddings are the prompt
        if request.token_ids is not None:
            return list(request.token_ids)
        tokenizer = self.tokenizer
        if request.messages is not None:
            return tokenizer.encode_chat(request.messages)
        return tokenizer.encode_prompt(request.prompt or "")

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer wrapper (see :mod:`kvflow.models.tokenizer`)."""
        tok = self.engine.tokenizer if isinstance(self.engine, HasTokenizer) else None
        if tok is None:
            from kvflow.models.tokenizer import load_tokenizer

            tok = load_tokenizer(self.config.tokenizer)
        return tok

    async def _generate(self, request: InferenceRequest, received_ms: int) -> None:
        if request.deadline_ms is not None and now_ms() > request.deadline_ms:
            # Ended by its deadline before its timer fired: counted in ``expired`` here, and
            # marked so that the timer or a client's deadline cancel does not count it again.
            item = self.inflight.get(request.request_id)
            if item is not None and item.cancel is None:
                item.cancel = self._deadline_cancel(request)
                self._count_cancel(item.cancel)
            await disagg.release_unpulled(self, request)
            await self._send(request, FinalResponse(
                request_id=request.request_id, finish_reason=FinishReason.error, worker_id=self.config.worker_id,
                routing=request.routing, error=deadline_exceeded("deadline passed before the request started")))
            return
        try:
            stage = parse_stage(request.disaggregated_params)
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        if stage is not None and (request.prompt_embeds is not None or request.media):
            raise EngineError("prompt embeddings and media are served by aggregated workers only")
        with tracer().start_as_current_span("engine generate") as span:
            span.set_attribute("kvflow.engine", self.engine.name)
            if isinstance(stage, PrefillStage):
                span.set_attribute("kvflow.stage", "prefill")
                await disagg.serve_prefill(self, request, stage, received_ms)
                return
            if isinstance(stage, DecodeStage):
                span.set_attribute("kvflow.stage", "decode")
                await disagg.serve_decode(self, request, stage, received_ms)
                return
            prompt_ids = self.prompt_ids(request)
            embeds = None
            if request.prompt_embeds is not None:
                if not self.engine.accepts_prompt_embeds:
                    raise EngineError(f"the {self.engine.name} engine takes no prompt embeddings")
                from kvflow.workers.prompt_embeds import to_tensor

                embeds = to_tensor(request.prompt_embeds)
            media = ()
            if request.media:
                if not self.engine.accepts_media:
                    raise EngineError(f"the {self.engine.name} engine takes no media")
                from kvflow.workers.prompt_embeds import media_inputs

                media = media_inputs(request.media)
            if request.lora_name:
                await self._ensure_adapter(request.lora_name)
            gen = GenerateRequest(request_id=request.request_id, prompt_token_ids=prompt_ids,
                                  sampling=request.sampling, lora_name=request.lora_name,
                                  resumed_tokens=request.resumed_tokens, prompt_embeds=embeds, media=media)
            await self.stream_outputs(request, prompt_ids, self.engine.generate(gen), received_ms, now_ms())

    async def _ensure_adapter(self, name: str) -> None:
        """Load LoRA adapter ``name`` on demand when its URI is known and it is not loaded here
        (the router picked this worker though none free had it); heartbeat the new list.

        An engine without adapter loading decides alone (the mocker only salts
        its block hashes with the name; vLLM refuses).

        Raises:
            EngineError: the load failed.
        """
        adapters = self.adapters
        if adapters is None:
            return
        uri = self.adapter_uris.get(name)
        if name in adapters or uri is None:
            return  # loaded, or unknown here: the engine answers the request (an error when unknown)
        try:
            await adapters.load(name, uri)
        except AdapterError as exc:
            raise EngineError(str(exc)) from exc
        await self.publish_heartbeat()

    async def stream_outputs(self, request: InferenceRequest, prompt_ids: list[int],
                             outputs: AsyncIterator[EngineOutput], received_ms: int, started_ms: int, *,
                             cached_tokens: int | None = None, kv_transfer: KvTransferInfo | None = None) -> None:
        """Stream an engine's ``outputs`` for ``request`` to its ``reply_to``: detokenize,
        apply stop strings, send :class:`TokenDelta` records, then the :class:`FinalResponse`.

        The first output is sent at once; later ones are coalesced into one
        delta per ``settings.stream_flush_tokens`` tokens, or at the first
        engine output after the next tick of a clock ticking every
        ``settings.stream_flush_ms`` (:func:`flush_tick`), whichever comes
        first, and whatever is buffered goes out before the final response.
        The clock is shared by all of the worker's streams, so the deltas of
        one engine step leave together and share one produce request. Fewer,
        bigger records cut the broker and reader work per token
        (docs/benchmarks.md, "Live path").

        ``cached_tokens`` overrides the prefix-cache hit reported by the
        first output (a remote prefill reports the prefill worker's);
        ``kv_transfer`` is echoed on the final response.
        """
        from kvflow.models.tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopChecker(request.sampling.stop)
        flush_tokens = self.settings.stream_flush_tokens
        flush_s = self.settings.stream_flush_ms / 1000
        first_ms = 0
        cached = 0
        output_ids: list[int] = []
        index = 0
        finish = FinishReason.length
        text_parts: list[str] = []
        buf_ids: list[int] = []
        buf_text: list[str] = []
        buf_tick = 0
        timer = self.prom.track()
        timer.started_s -= max(0, now_ms() - received_ms) / 1000  # TTFT counts from the queue record's arrival

        async def flush() -> None:
            nonlocal index
            if buf_ids or buf_text:
                await self._send(request, TokenDelta(request_id=request.request_id, index=index,
                                                     token_ids=list(buf_ids), text="".join(buf_text),
                                                     worker_id=self.config.worker_id))
                index += 1
                buf_ids.clear()
                buf_text.clear()

        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if not first_ms:
                    first_ms = now_ms()
                    cached = out.num_cached_tokens if cached_tokens is None else cached_tokens
                timer.output(len(out.token_ids), prompt_tokens=len(prompt_ids), cached_tokens=cached)
                output_ids.extend(out.token_ids)
                text, stopped = stops.feed(detok.add(out.token_ids))
                if stopped:
                    await self.engine.abort(request.request_id)
                    finish = FinishReason.stop
                elif out.finish_reason is not None:
                    finish = out.finish_reason
                    text += stops.flush() + detok.flush()
                elif self.is_cancelled(request.request_id):
                    # The cancel came before the engine knew the request (its
                    # abort was a no-op) or while this output was queued.
                    await self.engine.abort(request.request_id)
                    finish = FinishReason.abort
                    stopped = True
                    text += stops.flush() + detok.flush()
                if text or out.token_ids:
                    text_parts.append(text)
                    tick = flush_tick(flush_s)
                    if not buf_ids and not buf_text:
                        buf_tick = tick
                    buf_ids.extend(out.token_ids)
                    buf_text.append(text)
                    if index == 0 or len(buf_ids) >= flush_tokens or tick != buf_tick:
                        await flush()
                if stopped or out.finish_reason is not None:
                    break
        await flush()
        expired = finish is FinishReason.abort and self._expired(request.request_id)
        timer.finish((FinishReason.error if expired else finish).value)
        final = FinalResponse(
            request_id=request.request_id, text="".join(text_parts), token_ids=output_ids,
            finish_reason=FinishReason.error if expired else finish,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(output_ids), cached_tokens=cached),
            timings=Timings(queued_ms=received_ms, started_ms=started_ms, first_token_ms=first_ms,
                            finished_ms=now_ms()),
            worker_id=self.config.worker_id, routing=request.routing, kv_transfer=kv_transfer,
            error=self._deadline_error(request) if expired else None,
        )
        span = trace.get_current_span()
        span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
        span.set_attribute("gen_ai.usage.output_tokens", len(output_ids))
        span.set_attribute("kvflow.cached_tokens", cached)
        # Routers learn the worker is free before the client learns the answer: a client
        # that sends its next request on receipt is routed with this one counted as done.
        await self._publish_finished(request, self.is_cancelled(request.request_id))
        self._finish_published.add(request.request_id)
        await self._send(request, final)

    # side streams ------------------------------------------------------------

    def _heartbeat_record(self) -> WorkerHeartbeat:
        stats = self.engine.kv_stats()
        return WorkerHeartbeat(
            worker_id=self.config.worker_id, role=self.config.role, status=self.status, model=self.config.model,
            engine=self.engine.name, tokenizer=self.config.tokenizer, block_size=stats.block_size,
            context_length=self.engine.context_length,
            kv_total_blocks=stats.total_blocks, kv_used_blocks=stats.used_blocks,
            queue_topic=self.queue_tp.topic, queue_partition=self.queue_tp.partition,
            active_requests=stats.active_requests, waiting_requests=stats.waiting_requests,
            active_prefill_tokens=stats.active_prefill_tokens, ts_ms=now_ms(),
            ttl_ms=self.settings.worker_ttl_ms + (self._idle_period_ms() - self.settings.heartbeat_interval_ms
                                                  if self._idle() else 0),
            started_ms=self.started_ms,
            host=f"{socket.gethostname()}:{os.getpid()}",
            lifecycle_seq=self.lifecycle_seq, inflight_requests=len(self.inflight), pool=self.config.pool,
            lora_adapters=self.adapters.names() if self.adapters is not None else [],
        )

    async def _heartbeat(self) -> None:
        self._heartbeat_wake.set()
        await self.producer.send_and_wait(self.catalog.workers.name, encode(self._heartbeat_record()),
                                          key=self.config.worker_id.encode())
        produced(self.catalog.workers.name)  # a start or status change: routers and bridges should see it now

    async def publish_heartbeat(self) -> None:
        """Publish a heartbeat now (its status reaches routers without waiting for the next period)."""
        await self._heartbeat()

    def _idle(self) -> bool:
        return not self.inflight and self.status is WorkerStatus.serving

    def _idle_period_ms(self) -> int:
        idle = self.settings.heartbeat_idle_ms or 5 * self.settings.heartbeat_interval_ms
        return max(idle, self.settings.heartbeat_interval_ms)

    async def _heartbeat_loop(self) -> None:
        # Busy: a beat every interval. Idle and unchanged: one per idle period, with a TTL
        # stretched to match, so an idle deployment sends (and its readers fetch) 5x fewer.
        # Ticks sit on wall-clock multiples so idle workers beat together (heartbeat_clock).
        # Idle and unchanged, the loop parks until its next idle beat instead of waking every
        # tick to find nothing new; a request taken or a beat sent elsewhere wakes it.
        interval = self.settings.heartbeat_interval_ms / 1000
        last_metrics = time.monotonic()
        last_beat = time.time()
        last_state: dict | None = None
        tick = next_tick(time.time(), interval)
        parked = False
        while True:
            idle_s = self._idle_period_ms() / 1000
            park_tick = next_idle_beat_tick(last_beat, interval, idle_s) if parked else tick
            delay = tick_time(park_tick, interval) - time.time()
            if parked and delay <= idle_s:  # else the wall clock went back: tick on (wait_for_tick re-bases)
                tick = park_tick
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._heartbeat_wake.wait(), max(delay, 0.0))
                    tick, parked = next_tick(time.time(), interval), False  # woken early: back on every tick
                    continue
            else:
                tick, delay = wait_for_tick(tick, interval, time.time())
                await asyncio.sleep(delay)
            at = tick_time(tick, interval)
            tick = max(tick + 1, next_tick(time.time(), interval))  # a late loop skips ticks, never doubles
            self._heartbeat_wake.clear()  # set from here on: something changed after this snapshot
            parked = False
            try:
                record = self._heartbeat_record()
                state = record.model_dump(exclude={"ts_ms"})
                if (state == last_state and self._idle()
                        and not idle_beat_due(last_beat, at, idle_s)):
                    parked = True
                    continue
                last_state, last_beat = state, at
                sent = await self.producer.send(self.catalog.workers.name, encode(record),
                                                key=self.config.worker_id.encode())
                if time.monotonic() - last_metrics >= self.config.metrics_interval_s:
                    last_metrics = time.monotonic()
                    # Appended before the sender runs, so both go in one produce request.
                    await self.producer.send(self.catalog.metrics.name, encode(self._metrics_record()),
                                             key=self.config.worker_id.encode())
                await sent
            except Exception:  # noqa: BLE001 - keep beating through transient broker errors
                log.exception("heartbeat failed")

    def _metrics_record(self) -> WorkerMetrics:
        stats = self.engine.kv_stats()
        t0, p0, d0 = self._last_tokens
        t1 = time.monotonic()
        dt = max(t1 - t0, 1e-6)
        self._last_tokens = (t1, stats.prefill_tokens_total, stats.decode_tokens_total)
        aborted, self._aborted_reported = self.aborted - self._aborted_reported, self.aborted
        return WorkerMetrics(
            ts_ms=now_ms(), worker_id=self.config.worker_id, role=self.config.role.value,
            active_requests=stats.active_requests, waiting_requests=stats.waiting_requests,
            kv_used_blocks=stats.used_blocks, kv_total_blocks=stats.total_blocks, queue_depth=len(self.inflight),
            prefill_tokens_per_s=(stats.prefill_tokens_total - p0) / dt,
            decode_tokens_per_s=(stats.decode_tokens_total - d0) / dt,
            aborted_requests=aborted, kv_tiers=self.engine.kv_tier_metrics(),
            spec_decode=self.engine.spec_decode_metrics(),
        )

    def _on_kv_events(self, events: list[KvEvent]) -> None:
        self.kv_pending.extend(events)
        self.kv_wakeup.set()

    async def _flush_kv_events(self, dump: bool = False, events: list[KvEvent] | None = None) -> None:
        if events is None:
            events, self.kv_pending = self.kv_pending, []
        if not events and not dump:
            return
        batch = KvEventBatch(worker_id=self.config.worker_id, event_id=self.next_event_id,
                             block_size=self.engine.block_size, ts_ms=now_ms(), events=events, dump=dump)
        self.next_event_id += 1
        await self.producer.send(self.catalog.kv_events.name, encode(batch), key=self.config.worker_id.encode())

    async def _kv_publisher(self) -> None:
        while True:
            await self.kv_wakeup.wait()
            self.kv_wakeup.clear()
            await self._flush_kv_events()

    async def _control_listener(self) -> None:
        while True:
            try:
                batches = await self.consumer.getmany(*self.control_tps, timeout_ms=FOLLOW_POLL_MS)
            except Exception:  # noqa: BLE001 - keep listening through transient broker errors
                log.exception("control consumer failed; retrying")
                await asyncio.sleep(0.5)
                continue
            await self._apply_control(batches)

    async def _apply_control(self, batches: dict[TopicPartition, list[Any]]) -> None:
        for records in batches.values():
            for msg in records:
                try:
                    await self._on_control(msg)
                except Exception:  # noqa: BLE001 - one record must not stop cancels and dumps
                    log.exception("control record %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)

    async def _on_control(self, msg: Any) -> None:
        if msg.topic == self.catalog.control.name:
            try:
                record = decode(ControlRecord, msg.value)
            except RecordError:
                return  # dead-lettered once by the router's check_control
            if isinstance(record, AdminCommand) and record.action is AdminAction.load_lora and record.lora_uri:
                self.adapter_uris[record.lora_name] = record.lora_uri
            if isinstance(record, AdminCommand) and record.worker_id == self.config.worker_id:
                # A task: a sleep waits for in-flight requests, and cancels must keep flowing meanwhile.
                task = asyncio.create_task(admin.apply(self, record), name=f"admin-{record.command_id}")
                self._admin_tasks.add(task)
                task.add_done_callback(self._admin_tasks.discard)
            return
        if msg.topic == self.catalog.cancels.name:
            try:
                record = decode(CancelRequest, msg.value)
            except RecordError:
                self.malformed_cancels += 1  # dead-lettered once by the router's check_cancels
                return
            await self.cancel(record)
            return
        try:
            req = decode(KvDumpRequest, msg.value)
        except RecordError:
            return  # dead-lettered once by the router's check_kv_dump_requests
        if req.worker_id == self.config.worker_id:
            await self._publish_dump()

    async def _publish_dump(self) -> None:
        if not isinstance(self.engine, DumpsKvEvents):
            return
        await self._flush_kv_events()
        await self._flush_kv_events(dump=True, events=list(self.engine.dump_kv_events()))

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly status dict (for logs and tests)."""
        return {"worker_id": self.config.worker_id, "status": self.status.value, "inflight": len(self.inflight),
                "served": self.served, "aborted": self.aborted, "expired": self.expired,
                "malformed_cancels": self.malformed_cancels,
                "skipped_foreign": self.skipped_foreign,
                "dead_letters": self.dlq.count}


