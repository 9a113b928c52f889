"""The router: a Faust app around a :class:`~kvflow.router.core.RouterCore`.

The core decides (routing policy, load shedding, the bounded queue,
disaggregation, in-flight accounting) and does no I/O; this module feeds it
records and carries out its effects as records, so the offline simulator,
an adapter around the same core, decides as this app does.

State every replica shares, folded into its core from whole topics (all
partitions, from the beginning — :mod:`kvflow.router.projections`), so
replicas and restarted routers hold identical state:

- the in-memory :class:`~kvflow.router.table.RoutingTable` from the workers
  topic (heartbeats, drains, stops; silent workers expire);
- the global :class:`~kvflow.router.index.KvIndex` from the kv-events topic
  (only for KV-event policies), with gap detection and dump requests;
- each worker's in-flight requests from the inflight topic (taken and
  ended requests, :mod:`kvflow.router.inflight`), reconciled with its
  heartbeats into the table's load figures, plus the requests this replica
  routed and the worker has not taken yet;
- in ``queue`` shedding mode, the cancels topic: a cancelled request this
  replica holds leaves the queue and is answered ``abort``.

Every heartbeat interval the ``housekeeping`` timer ticks the core: expired
workers (their requests routed here are answered ``worker_lost``,
:mod:`kvflow.router.orphans`), KV dump requests, and held requests released
to workers or dropped at their deadline.

Before each decision of a KV-event policy the router waits (at most
:data:`KV_CATCH_UP_S`) until its index has folded the KV events that workers
published before their latest finish records, so a prompt repeated right
after its request ended finds its prefix in the index.

Faust agents (consumer group, so each record is handled once per group):

- ``route_requests`` decodes each request and asks the core
  (:meth:`~kvflow.router.core.RouterCore.route`), which applies load
  shedding (:mod:`~kvflow.router.shedding`), asks the policy for a worker
  and decides local or remote prefill (:mod:`~kvflow.router.disagg`); a
  routed request goes with its :class:`~kvflow.schemas.RoutingDecision` to
  the worker's queue partition — by way of an encode worker when its media
  still carry bytes (:mod:`kvflow.router.encode`; 503 ``no_encode_workers``
  when none serves the model). A shed or rejected one (no worker) is
  answered directly with an error :class:`~kvflow.schemas.FinalResponse`
  (HTTP 503 semantics). Every
  decision (routed, queued, shed or rejected) is also published, without
  waiting for the broker's ack, as a :class:`~kvflow.schemas.DecisionRecord`
  on the routing-decisions topic, with the candidates the policy weighed
  and its cost terms (``kvflow explain REQUEST_ID`` reads it).
- ``check_folded_topics`` (a task, not an agent) dead-letters malformed
  heartbeats, KV event batches (binary or legacy JSON, checked with the same
  :func:`~kvflow.schemas.decode_kv_frame` the index projection uses, so the
  two agree on what is malformed) and inflight records: every replica folds
  these topics whole, and this reader's own consumer group
  (:mod:`kvflow.router.validation`) picks the one replica that writes the
  letter. It reads a batch a second, so a Faust agent on these busy topics
  no longer keeps the requests consumer fetching.
- ``check_cancels`` dead-letters malformed cancel records. Every worker
  reads the whole cancels topic and skips them, so each bad record is
  dead-lettered once, not once per worker.
- ``check_kv_dump_requests`` dead-letters malformed KV dump requests, which
  every worker also reads whole and skips.
- ``check_control`` dead-letters malformed control records (engine admin
  commands and answers), which every worker reads whole and skips.

The whole-topic projections skip the records these readers dead-letter, so
each malformed record reaches the dead-letter topic once per deployment,
however many router replicas and workers read it. No agent dies of one.

Observability: each decision runs under a ``router route`` span continuing
the trace in the request record's ``traceparent`` header, and the queue
record it sends carries that span's context on to the worker
(:mod:`kvflow.streams.tracing`); the app's Prometheus series are in
:attr:`RouterApp.prom` (:mod:`kvflow.router.prometheus`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import shutil
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import faust
from opentelemetry import context as otel_context
from opentelemetry import trace

from kvflow.router.core import Arrival, Cancelled, Decision, Effect, KvDumpNeeded, RouterCore, WorkerExpired
from kvflow.router.disagg import DisaggConfig, routed_record
from kvflow.router.encode import encode_key, pick_encode_worker
from kvflow.router.kv_policy import KvPolicyConfig
from kvflow.router.orphans import Orphans, Routed
from kvflow.router.pools import load_pool_grid
from kvflow.router.projections import Follow, follow_topics
from kvflow.router.prometheus import RouterExporter
from kvflow.router.quiet_monitor import QuietMonitor
from kvflow.router.shedding import BoundedRequestQueue, ShedConfig
from kvflow.router.table import RoutingTable
from kvflow.router.validation import validate_paced
from kvflow.schemas import (
    CancelRequest,
    ControlRecord,
    DeadLetter,
    DecisionOutcome,
    DecisionRecord,
    EncodeForward,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    InflightRecord,
    KvDumpRequest,
    RecordError,
    ReplyTo,
    RequestFinished,
    WorkerHeartbeat,
    decode,
    decode_kv_frame,
    encode,
    now_ms,
)
from kvflow.schemas.block_hash import BlockSizeMismatch
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced, wake_policy
from kvflow.streams.kafka import bootstrap, fetch_wait_policy
from kvflow.streams.kafka_security import faust_security
from kvflow.streams.tansu_compat import patch_faust_fetch_wait
from kvflow.streams.tracing import extract_context, inject_headers, tracer
from kvflow.streams.workers import liveness_wait

__all__ = ["RouterApp", "build_router_app", "faust_data_dir"]

log = logging.getLogger(__name__)

KV_CATCH_UP_S = 0.2
"""Longest a decision waits for the KV events that workers published before
their latest finish records (the KV projection usually folds them within a
fetch, a few ms). A worker whose events do not come in time is not waited
for again until its index cursor moves (:func:`~kvflow.router.inflight.waive_kv`)."""

ADAPTER_COUNTERS = ("dead_lettered", "kv_waits", "kv_wait_timeouts", "worker_lost", "decisions", "decisions_lost")
"""Counters the app adds to :attr:`RouterCore.counters <kvflow.router.core.RouterCore.counters>`."""


@dataclass
class RouterApp:
    """A built router: the Faust app around its :class:`~kvflow.router.core.RouterCore`."""

    app: faust.App
    core: RouterCore
    settings: Settings
    catalog: Catalog
    router_id: str
    policy: str
    workers_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the workers topic's history has been folded into the table."""
    kv_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the kv-events topic's history has been folded into the index."""
    inflight_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the inflight topic's history has been folded into the table."""
    kv_progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set each time a KV event batch is folded (wakes a decision waiting for one)."""
    projection_waits: list = field(default_factory=list)
    """Fetch-wait policies of the inflight and kv-events projections (woken by each request)."""
    orphans: Orphans = field(default_factory=Orphans)
    """Requests this replica routed, until their worker reports them finished
    (answered ``worker_lost`` if the worker expires first)."""
    prom: RouterExporter | None = None
    """The router's Prometheus series (:mod:`kvflow.router.prometheus`)."""
    validators: list = field(default_factory=list)
    """The started consumer of :func:`~kvflow.router.validation.validate_paced` (empty until it starts)."""

    def assigned(self) -> set[tuple[str, int]]:
        """``(topic, partition)`` pairs this replica's consumer groups hold now:
        its Faust agents' and its validators' (empty before either joins)."""
        tps = set(self.app.consumer.assignment())
        for consumer in self.validators:
            tps |= consumer.assignment()
        return {(tp.topic, tp.partition) for tp in tps}

    @property
    def table(self) -> RoutingTable:
        """The core's routing table (workers, in-flight load, KV index)."""
        return self.core.table

    @property
    def queue(self) -> BoundedRequestQueue | None:
        """Requests held while every worker is busy (``shed_mode="queue"``), else None."""
        return self.core.queue

    @property
    def counters(self) -> dict[str, int]:
        """Event counts: the core's (:data:`kvflow.router.core.COUNTERS`) and the app's (:data:`ADAPTER_COUNTERS`)."""
        return self.core.counters


def faust_data_dir() -> str:
    """A new directory for one router app's Faust data, removed when this process exits.

    Faust creates its table directories under ``datadir`` even with memory
    storage, and the default lies in the working directory; every router app
    built (a test session builds hundreds) left an empty tree in the temp
    directory before it was removed at exit.

    Raises:
        OSError: the directory cannot be created.
    """
    path = tempfile.mkdtemp(prefix="kvflow-router-")
    atexit.register(shutil.rmtree, path, True)
    return path


def build_router_app(settings: Settings, catalog: Catalog | None = None, *, policy: str | None = None,
                     router_id: str | None = None, app_id: str | None = None) -> RouterApp:
    """Build (not start) the router Faust app.

    ``app_id`` is the Faust app id = consumer group; router replicas that
    split the request stream share one id. Start it with
    ``await router.app.start()`` (or ``faust worker`` style via the CLI).
    The app connects with the settings' Kafka TLS/SASL
    (:func:`kvflow.streams.kafka_security.faust_security`).

    Raises:
        KeyError: ``policy`` is not a registered policy.
        ValueError: a SASL protocol without username and password.
    """
    catalog = catalog or Catalog(settings.namespace)
    policy = policy or settings.routing_policy
    router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
    core = RouterCore(policy, kv=KvPolicyConfig.from_settings(settings), shed=ShedConfig.from_settings(settings),
                      disagg=DisaggConfig.from_settings(settings), router_id=router_id,
                      session_margin=settings.router_session_margin,
                      pools=load_pool_grid(settings.router_pool_grid) if settings.router_pool_grid else None)
    core.counters.update(dict.fromkeys(ADAPTER_COUNTERS, 0))
    if settings.embedded_broker:
        hot = {catalog.requests.name}  # only requests make the router's consumer poll fast
        # Bridges and KvflowClient ring the router with every request (fetch_wait.produced), so
        # its consumer parks once the requests stop instead of stepping its wait up over seconds
        # (docs/benchmarks.md, "The router's request reader parks"); a producer that does not
        # ring waits at most the plain idle wait, not the longer one of rung consumers.
        patch_faust_fetch_wait(settings.fetch_max_wait_ms,
                               functools.partial(fetch_wait_policy, settings, hot.__contains__, rung=True,
                                                 idle_ms=settings.fetch_idle_wait_ms))

    app = faust.App(
        app_id or f"{settings.namespace}-router",
        broker=f"kafka://{bootstrap(settings)}",
        store="memory://",
        datadir=faust_data_dir(),
        web_enabled=False,
        Monitor=QuietMonitor,  # no rates are read: no sampler waking every second
        autodiscover=False,
        producer_linger_ms=0,
        producer_max_request_size=settings.max_record_bytes,
        producer_acks=1,
        broker_session_timeout=settings.session_timeout_ms / 1000,
        # Kafka's guidance for heartbeat.interval.ms: at most a third of the session timeout.
        broker_heartbeat_interval=max(0.1, settings.session_timeout_ms / 3000),
        broker_request_timeout=max(40.0, settings.session_timeout_ms / 1000 + 5),
        consumer_auto_offset_reset="latest",
        topic_allow_declare=True,
        topic_disable_leader=True,
        table_cleanup_interval=3600.0,
        stream_wait_empty=False,
        **faust_security(settings),
    )
    state = RouterApp(app=app, core=core, settings=settings, catalog=catalog, router_id=router_id, policy=policy,
                      prom=RouterExporter(router_id, policy))
    prom = state.prom
    prom.attach(state)

    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    requests_topic = app.topic(catalog.requests.name, partitions=catalog.requests.partitions, **raw)
    cancels_topic = app.topic(catalog.cancels.name, partitions=catalog.cancels.partitions, **raw)
    dumps_topic = app.topic(catalog.kv_dump_requests.name, partitions=catalog.kv_dump_requests.partitions, **raw)
    control_topic = app.topic(catalog.control.name, partitions=catalog.control.partitions, **raw)
    counters = core.counters
    held_traces: OrderedDict[str, otel_context.Context] = OrderedDict()  # trace context of each queued request

    async def dead_letter(event: faust.EventT, error: str) -> None:
        await dead_letter_message(event.message, error)

    async def dead_letter_message(msg: Any, error: str) -> None:
        # ``msg``: a Faust message or an aiokafka record (topic, partition, offset, key, value)
        counters["dead_lettered"] += 1
        record = DeadLetter.of(source_topic=msg.topic, partition=msg.partition, offset=msg.offset, key=msg.key,
                               value=msg.value, error=error, consumer=router_id)
        log.warning("dead-lettering %s@%d: %s", msg.topic, msg.offset, error[:200])
        await app.producer.send(catalog.dead_letter.name, msg.topic.encode(), encode(record), None, None, None)

    def validator(schema: type, parse: Callable[[bytes], object] | None = None,
                  ) -> Callable[[faust.StreamT], Awaitable[None]]:
        # Validation only: the readers that act on these records skip the ones that fail here.
        # ``parse`` replaces decode(schema, ...) where the readers use a cheaper, equally strict decoder.
        check_one = parse or functools.partial(decode, schema)

        async def check(stream: faust.StreamT) -> None:
            async for event in stream.events():
                try:
                    check_one(event.value)
                except RecordError as exc:
                    await dead_letter(event, str(exc))
        return check

    app.agent(cancels_topic, name="check_cancels")(validator(CancelRequest))
    app.agent(dumps_topic, name="check_kv_dump_requests")(validator(KvDumpRequest))
    app.agent(control_topic, name="check_control")(validator(ControlRecord))

    @app.task
    async def check_folded_topics() -> None:
        # The topics every replica folds whole, checked once per deployment in a group of their own.
        checks: dict[str, Callable[[bytes], object]] = {
            catalog.workers.name: functools.partial(decode, WorkerHeartbeat),
            catalog.kv_events.name: decode_kv_frame,
            catalog.inflight.name: functools.partial(decode, InflightRecord),
        }
        await validate_paced(settings, f"{app.conf.id}-validators", checks, dead_letter_message,
                             consumers=state.validators)

    # ---- the log, folded into the core (every replica reads every record) ----

    async def on_worker_record(msg) -> None:
        try:
            hb = decode(WorkerHeartbeat, msg.value)
        except RecordError:
            return  # dead-lettered once by check_folded_topics
        core.on_heartbeat(hb)

    async def on_kv_record(msg) -> None:
        try:
            batch = decode_kv_frame(msg.value)  # hashes stay in the record's bytes; the index reads them there
        except RecordError:
            return  # dead-lettered once by check_folded_topics
        try:
            dump = core.on_kv_batch(batch)
        except BlockSizeMismatch as exc:
            log.error("refusing KV events of %s: %s", batch.worker_id, exc)
            return
        prom.on_kv_batch(batch.ts_ms, now_ms())
        state.kv_progress.set()
        if dump is not None:
            await request_dump(dump.worker_id)

    async def on_inflight_record(msg) -> None:
        try:
            record = decode(InflightRecord, msg.value)
        except RecordError:
            return  # dead-lettered once by check_folded_topics
        if isinstance(record, RequestFinished):
            core.on_request_finished(record)
            state.orphans.finished(record.request_id, record.worker_id)
            for effect in core.release_freed(now_ms()):  # one ended: one held request may start
                await carry_out(effect)
        else:
            core.on_request_admitted(record)
            state.orphans.admitted(record.request_id, record.worker_id)

    async def on_cancel_record(msg) -> None:
        try:
            cancel = decode(CancelRequest, msg.value)
        except RecordError:
            return  # dead-lettered once by check_cancels
        for effect in core.on_request_cancelled(cancel.request_id):
            await carry_out(effect)

    @app.task
    async def project_state() -> None:
        # One consumer: heartbeats, then KV events, then finish records of each fetch.
        follows = [Follow(catalog.workers, on_worker_record, state.workers_caught_up, hot=False)]
        if core.uses_events:
            follows.append(Follow(catalog.kv_events, on_kv_record, state.kv_caught_up))
        follows.append(Follow(catalog.inflight, on_inflight_record, state.inflight_caught_up))
        if core.queue is not None:
            # Only held requests need the router to see cancels; the replica holding one may not be
            # the one the consumer group gives the cancel to, so each replica reads them all.
            follows.append(Follow(catalog.cancels, on_cancel_record, hot=False))
        # It folds the heartbeats the router judges liveness by: its quiet wait is bounded by that.
        await follow_topics(settings, follows, policies=state.projection_waits,
                            idle_cap=liveness_wait(settings, core.table.live))

    @app.timer(interval=max(0.05, settings.heartbeat_interval_ms / 1000))
    async def housekeeping() -> None:
        if any(s.held() for s in core.table.inflight.workers.values()):
            for wait in state.projection_waits:  # finish records and KV events are on their way
                wake_policy(wait)
        for effect in core.tick(now_ms()):
            await carry_out(effect)

    # ---- requests ------------------------------------------------------------

    @app.agent(requests_topic, name="route_requests")
    async def route_requests(stream: faust.StreamT) -> None:
        async for event in stream.events():
            try:
                request = decode(InferenceRequest, event.value)
            except RecordError as exc:
                await dead_letter(event, str(exc))
                continue
            # The request's trace continues here (its traceparent header) and goes on to the worker.
            with tracer().start_as_current_span("router route", context=extract_context(event.message.headers),
                                                kind=trace.SpanKind.CONSUMER) as span:
                span.set_attribute("kvflow.request_id", request.request_id)
                try:
                    await route_one(request)
                except Exception as exc:  # noqa: BLE001 - one bad request must not stop the router
                    log.exception("routing %s failed", request.request_id)
                    await dead_letter(event, f"routing failed: {exc!r}")

    async def route_one(request: InferenceRequest) -> None:
        for wait in state.projection_waits:  # traffic: keep the load and cache views fresh
            wake_policy(wait)  # a projection parked in a long poll after a quiet spell polls again now
        if not (state.workers_caught_up.is_set() and state.inflight_caught_up.is_set()):
            # First requests after a (re)start: let the table catch up with the log.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(state.workers_caught_up.wait(),
                                                      state.inflight_caught_up.wait()), 5.0)
        with prom.decide.labels(router_id).time():
            if core.uses_events:
                await wait_for_finished_kv()
            decision = core.route(Arrival.of(request), now_ms())
        await carry_out(decision)

    async def wait_for_finished_kv() -> None:
        # The index should hold the KV events published before the finish records folded so far.
        lagging = core.kv_lagging()
        if not lagging:
            return
        counters["kv_waits"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + KV_CATCH_UP_S
        while lagging:
            remaining = deadline - loop.time()
            if remaining <= 0:
                counters["kv_wait_timeouts"] += 1
                log.warning("KV events of %s not folded within %.0f ms of their finish records; routing without",
                            lagging, KV_CATCH_UP_S * 1000)
                core.waive_kv(lagging)
                return
            state.kv_progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.kv_progress.wait(), remaining)
            lagging = core.kv_lagging(lagging)

    # ---- effects → records ---------------------------------------------------------

    async def carry_out(effect: Effect) -> None:
        if isinstance(effect, Decision):
            await carry_out_decision(effect)
        elif isinstance(effect, WorkerExpired):
            await answer_lost(effect.worker_id)
        elif isinstance(effect, KvDumpNeeded):
            await request_dump(effect.worker_id)
        elif isinstance(effect, Cancelled):
            request: InferenceRequest = effect.arrival.payload
            held_traces.pop(request.request_id, None)
            final = FinalResponse(request_id=request.request_id, finish_reason=FinishReason.abort,
                                  attempt=request.attempt)
            await app.producer.send(request.reply_to.topic, request.request_id.encode(), encode(final),
                                    request.reply_to.partition, None, None)

    async def carry_out_decision(decision: Decision) -> None:
        for worker_id in decision.expired:
            await answer_lost(worker_id)
        request: InferenceRequest = decision.arrival.payload
        span = trace.get_current_span()  # the request's "router route" span (none for a request leaving the queue)
        span.set_attribute("kvflow.outcome", decision.outcome.value)
        if decision.outcome is DecisionOutcome.queued:
            held_traces[request.request_id] = otel_context.get_current()  # its worker record continues this trace
            held_traces.move_to_end(request.request_id)
            while len(held_traces) > settings.shed_queue_capacity:
                held_traces.popitem(last=False)
        trace_ctx = held_traces.pop(request.request_id, None) if decision.outcome is not DecisionOutcome.queued \
            else None
        if decision.outcome is DecisionOutcome.routed:
            await send_routed(decision, request, trace_ctx)
        elif decision.error is not None:
            error = decision.error
            await send_error(request.request_id, request.reply_to, request.attempt, error.message,
                             status=error.status, code=error.code, retry_after_s=error.retry_after_s)
        prom.on_decision(decision)
        await publish_decision(decision)
        for shed_one in decision.displaced:  # held requests a higher-ranked arrival pushed out
            await carry_out_decision(shed_one)

    async def send_routed(decision: Decision, request: InferenceRequest,
                          trace_ctx: otel_context.Context | None) -> None:
        # To the chosen worker's queue, or to an encode worker that sends it on there.
        placement, target = decision.placement, decision.target
        span = trace.get_current_span()
        span.set_attribute("kvflow.worker_id", placement.decision.worker_id)
        span.set_attribute("kvflow.overlap_blocks", placement.decision.overlap_blocks)
        record = routed_record(request, placement.decision, decision.decode_worker, placement.plan.remote)
        topic, partition = target.queue_topic, target.queue_partition
        encode_worker_id = None
        if request.needs_encoding:  # its media go through an encode worker, which sends it on there
            encoder = pick_encode_worker(core.table.workers.values(), request.model, encode_key(request))
            if encoder is None:
                await send_error(request.request_id, request.reply_to, request.attempt,
                                 f"no encode worker serves the media of model {request.model}", status=503,
                                 code="no_encode_workers", retry_after_s=1)
                return
            record = record.model_copy(update={"forward_to": EncodeForward(topic=topic, partition=partition)})
            topic, partition = encoder.queue_topic, encoder.queue_partition
            span.set_attribute("kvflow.encode_worker_id", encoder.worker_id)
            encode_worker_id = encoder.worker_id
        await app.producer.send(topic, request.request_id.encode(), encode(record), partition, None,
                                inject_headers(trace_ctx))
        produced(topic, partition)  # its worker may be parked in a long poll
        state.orphans.note(Routed(request.request_id, placement.decision.worker_id,
                                  placement.decision.prefill_worker_id, request.reply_to, request.attempt,
                                  encode_worker_id))

    def decision_lost(ack: asyncio.Future) -> None:
        if not ack.cancelled() and ack.exception() is not None:
            counters["decisions_lost"] += 1
            log.warning("routing decision record not delivered: %r", ack.exception())

    async def publish_decision(decision: Decision) -> None:
        # Built from what the policy computed; sent without waiting for the ack. A record that
        # cannot be built or sent is counted and logged, never retried, and never fails the
        # request: the decision it describes has been carried out already.
        arrival, placement = decision.arrival, decision.placement
        chosen = placement.decision if placement is not None else None
        plan = placement.plan if placement is not None else None
        prefill = plan.prefill if plan is not None else None
        pools = decision.pools
        try:
            record = DecisionRecord(
                request_id=arrival.request_id, model=arrival.model, outcome=decision.outcome, policy=policy,
                router_id=router_id, decided_ms=decision.decided_ms, isl=arrival.isl, role=decision.role,
                reason=decision.reason,
                worker_id=chosen.worker_id if chosen is not None else None,
                prefill_worker_id=chosen.prefill_worker_id if chosen is not None else None,
                prefill_reason=plan.reason if plan is not None and plan.reason != "no_prefill_workers" else None,
                candidates=list(chosen.candidates) if chosen is not None else [],
                prefill_candidates=list(prefill.candidates) if prefill is not None else [],
                priority=arrival.priority, tenant=arrival.tenant or None, session_hit=decision.session_hit,
                prefill_pool=pools.prefill if pools is not None else None,
                decode_pool=pools.decode if pools is not None and not pools.fallback else None,
            )
            ack = await app.producer.send(catalog.routing_decisions.name, arrival.request_id.encode(),
                                          encode(record), None, None, None)
        except Exception:  # noqa: BLE001 - the audit record must not fail a routed request
            counters["decisions_lost"] += 1
            log.exception("routing decision record of %s not sent", arrival.request_id)
            return
        counters["decisions"] += 1
        if isinstance(ack, asyncio.Future):
            ack.add_done_callback(decision_lost)

    async def request_dump(worker_id: str) -> None:
        ask = KvDumpRequest(worker_id=worker_id, requested_by=router_id, ts_ms=now_ms())
        await app.producer.send(catalog.kv_dump_requests.name, worker_id.encode(), encode(ask), 0, None, None)
        produced(catalog.kv_dump_requests.name, 0)

    async def answer_lost(worker_id: str) -> None:
        for routed in state.orphans.take_lost([worker_id]):
            counters["worker_lost"] += 1
            log.warning("worker %s of %s expired before its part was done; answering worker_lost", worker_id,
                        routed.request_id)
            await send_error(routed.request_id, routed.reply_to, routed.attempt,
                             f"worker {worker_id} stopped responding before the request finished",
                             status=503, code="worker_lost", retry_after_s=1, worker_id=worker_id)

    async def send_error(request_id: str, reply_to: ReplyTo, attempt: int, message: str, *, status: int, code: str,
                         retry_after_s: int | None = None, worker_id: str = "") -> None:
        final = FinalResponse(
            request_id=request_id, finish_reason=FinishReason.error, worker_id=worker_id,
            error=ErrorInfo(message=message, type="service_unavailable" if status == 503 else "server_error",
                            code=code, status=status, retry_after_s=retry_after_s),
            attempt=attempt,
        )
        await app.producer.send(reply_to.topic, request_id.encode(), encode(final), reply_to.partition, None, None)

    return state
