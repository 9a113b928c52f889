"""The router: a Faust app that routes requests to worker queues.

State every replica shares, folded from whole topics (all partitions, from
the beginning — :mod:`kvflow.router.projections`), so replicas and restarted
routers hold identical state:

- the in-memory :class:`~kvflow.router.table.RoutingTable` from the workers
  topic (heartbeats, drains, stops; silent workers expire);
- the global :class:`~kvflow.router.index.KvIndex` from the kv-events topic
  (only for KV-event policies), with gap detection and dump requests;
- each worker's in-flight requests from the inflight topic (taken and
  ended requests, :mod:`kvflow.router.inflight`), reconciled with its
  heartbeats into the table's load figures, plus the requests this replica
  routed and the worker has not taken yet.

Before each decision of a KV-event policy the router waits (at most
:data:`KV_CATCH_UP_S`) until its index has folded the KV events that workers
published before their latest finish records, so a prompt repeated right
after its request ended finds its prefix in the index.

Faust agents (consumer group, so each record is handled once per group):

- ``route_requests`` decodes each request, applies load shedding
  (:mod:`~kvflow.router.shedding`), asks the policy for a worker, decides
  local or remote prefill (:mod:`~kvflow.router.disagg`), and forwards the
  request with its :class:`~kvflow.schemas.RoutingDecision` to the worker's
  queue partition. With no worker it answers the caller directly with an
  error :class:`~kvflow.schemas.FinalResponse` (HTTP 503 semantics). Every
  decision (routed, queued, shed or rejected) is also published, without
  waiting for the broker's ack, as a :class:`~kvflow.schemas.DecisionRecord`
  on the routing-decisions topic, with the candidates the policy weighed
  and its cost terms (``kvflow explain REQUEST_ID`` reads it).
- ``track_workers`` dead-letters malformed heartbeats (every replica folds
  the workers topic itself, from its beginning; no changelogged table is
  kept, since nothing read it and each heartbeat cost a changelog write).
- ``check_kv_events`` dead-letters malformed KV event batches (binary or
  legacy JSON), with the same :func:`~kvflow.schemas.decode_kv_frame` the
  index projection uses, so the two agree on what is malformed; neither
  builds a pydantic object per event of a binary record.
- ``check_cancels`` dead-letters malformed cancel records. Every worker
  reads the whole cancels topic and skips them, so each bad record is
  dead-lettered once, not once per worker.
- ``check_inflight`` dead-letters malformed inflight records (the
  projection of every replica skips them).
- ``check_kv_dump_requests`` dead-letters malformed KV dump requests, which
  every worker also reads whole and skips.
- ``check_control`` dead-letters malformed control records (engine admin
  commands and answers), which every worker reads whole and skips.

The whole-topic projections skip the records these agents dead-letter, so
each malformed record reaches the dead-letter topic once per deployment,
however many router replicas and workers read it. No agent dies of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import faust

from kvflow.router.disagg import DisaggConfig, Placement, decode_role, route_and_forward
from kvflow.schemas.block_hash import BlockSizeMismatch, compute_block_hashes
from kvflow.router.index import KvIndex
from kvflow.router.inflight import apply_inflight_record, kv_lagging, waive_kv
from kvflow.router.kv_policy import EVENT_POLICIES, KvPolicyConfig
from kvflow.router.policies import NoWorkerAvailable, RouteRequest
from kvflow.router.projections import follow_topic
from kvflow.router.shedding import BoundedRequestQueue, QueueFull, ShedConfig, has_free_worker, shed
from kvflow.router.orphans import Orphans, Routed
from kvflow.router.table import RoutingTable, apply_heartbeat, expire_workers
from kvflow.schemas import (
    CancelRequest,
    ControlRecord,
    DeadLetter,
    DecisionOutcome,
    DecisionRecord,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    InflightRecord,
    KvDumpRequest,
    KvEventBatch,
    RecordError,
    ReplyTo,
    RequestFinished,
    WorkerHeartbeat,
    WorkerRole,
    decode,
    decode_kv_frame,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import bootstrap, fetch_wait_policy
from kvflow.streams.kafka_security import faust_security
from kvflow.streams.tansu_compat import patch_faust_fetch_wait

__all__ = ["RouterApp", "build_router_app"]

log = logging.getLogger(__name__)

KV_CATCH_UP_S = 0.2
"""Longest a decision waits for the KV events that workers published before
their latest finish records (the KV projection usually folds them within a
fetch, a few ms). A worker whose events do not come in time is not waited
for again until its index cursor moves (:func:`~kvflow.router.inflight.waive_kv`)."""


@dataclass
class RouterApp:
    """A built router: the Faust app plus the state its agents maintain."""

    app: faust.App
    table: RoutingTable
    settings: Settings
    catalog: Catalog
    router_id: str
    policy: str
    counters: dict[str, int] = field(default_factory=lambda: {
        "routed": 0, "rejected": 0, "dead_lettered": 0, "shed": 0, "queued": 0, "kv_batches": 0, "kv_gaps": 0,
        "inflight_records": 0, "kv_waits": 0, "kv_wait_timeouts": 0, "worker_lost": 0, "decisions": 0,
        "decisions_lost": 0})
    queue: BoundedRequestQueue | None = None
    """Requests held while every worker is busy (``shed_mode="queue"``)."""
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
    from kvflow.router.policies import POLICIES

    catalog = catalog or Catalog(settings.namespace)
    policy = policy or settings.routing_policy
    if policy not in POLICIES:
        raise KeyError(f"unknown routing policy {policy!r}; known: {sorted(POLICIES)}")
    router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
    if settings.embedded_broker:
        hot = {catalog.requests.name}  # only requests make the router's consumer poll fast
        patch_faust_fetch_wait(settings.fetch_max_wait_ms,
                               functools.partial(fetch_wait_policy, settings, hot.__contains__))

    app = faust.App(
        app_id or f"{settings.namespace}-router",
        broker=f"kafka://{bootstrap(settings)}",
        store="memory://",
        datadir=tempfile.mkdtemp(prefix="kvflow-router-"),  # Faust writes here; keep it out of the cwd
        web_enabled=False,
        autodiscover=False,
        producer_linger_ms=0,
        producer_max_request_size=settings.max_record_bytes,
        producer_acks=1,
        broker_session_timeout=settings.session_timeout_ms / 1000,
        broker_heartbeat_interval=max(0.1, settings.session_timeout_ms / 6000),
        broker_request_timeout=max(40.0, settings.session_timeout_ms / 1000 + 5),
        consumer_auto_offset_reset="latest",
        topic_allow_declare=True,
        topic_disable_leader=True,
        table_cleanup_interval=3600.0,
        stream_wait_empty=False,
        **faust_security(settings),
    )
    state = RouterApp(app=app, table=RoutingTable(kv_config=KvPolicyConfig.from_settings(settings)),
                      settings=settings, catalog=catalog,
                      router_id=router_id, policy=policy)
    disagg_config = DisaggConfig.from_settings(settings)
    shed_config = ShedConfig(kv_threshold=settings.shed_kv_threshold,
                             prefill_token_threshold=settings.shed_prefill_token_threshold,
                             mode=settings.shed_mode, queue_capacity=settings.shed_queue_capacity,
                             queue_order=settings.shed_queue_order)
    if shed_config.mode == "queue":
        state.queue = BoundedRequestQueue(shed_config.queue_capacity, shed_config.queue_order)
    uses_events = policy in EVENT_POLICIES
    hashes_needed = policy not in ("round_robin", "random", "least_loaded")

    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    requests_topic = app.topic(catalog.requests.name, partitions=catalog.requests.partitions, **raw)
    workers_topic = app.topic(catalog.workers.name, partitions=catalog.workers.partitions, **raw)
    kv_events_topic = app.topic(catalog.kv_events.name, partitions=catalog.kv_events.partitions, **raw)
    cancels_topic = app.topic(catalog.cancels.name, partitions=catalog.cancels.partitions, **raw)
    inflight_topic = app.topic(catalog.inflight.name, partitions=catalog.inflight.partitions, **raw)
    dumps_topic = app.topic(catalog.kv_dump_requests.name, partitions=catalog.kv_dump_requests.partitions, **raw)
    control_topic = app.topic(catalog.control.name, partitions=catalog.control.partitions, **raw)

    async def dead_letter(event: faust.EventT, error: str) -> None:
        state.counters["dead_lettered"] += 1
        msg = event.message
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

    app.agent(workers_topic, name="track_workers")(validator(WorkerHeartbeat))
    app.agent(kv_events_topic, name="check_kv_events")(validator(KvEventBatch, decode_kv_frame))
    app.agent(cancels_topic, name="check_cancels")(validator(CancelRequest))
    app.agent(inflight_topic, name="check_inflight")(validator(InflightRecord))
    app.agent(dumps_topic, name="check_kv_dump_requests")(validator(KvDumpRequest))
    app.agent(control_topic, name="check_control")(validator(ControlRecord))

    async def on_worker_record(msg) -> None:
        try:
            hb = decode(WorkerHeartbeat, msg.value)
        except RecordError:
            return  # dead-lettered once by track_workers
        apply_heartbeat(state.table, hb)
        forget_restarted_or_stopped(hb)

    started_ms: dict[str, int] = {}

    def forget_restarted_or_stopped(hb: WorkerHeartbeat) -> None:
        # A stopped worker, or one restarted under the same id (its KV event
        # ids start again at 0), must not keep its old blocks in the index.
        previous = started_ms.get(hb.worker_id)
        gone = hb.worker_id not in state.table.workers
        if gone:
            started_ms.pop(hb.worker_id, None)
        else:
            started_ms[hb.worker_id] = hb.started_ms
        if isinstance(state.table.kv_index, KvIndex) and (gone or (previous is not None and previous != hb.started_ms)):
            state.table.kv_index.remove_worker(hb.worker_id)

    async def on_kv_record(msg) -> None:
        try:
            batch = decode_kv_frame(msg.value)  # hashes stay in the record's bytes; the index reads them there
        except RecordError:
            return  # dead-lettered once by check_kv_events
        if state.table.kv_index is None:
            state.table.kv_index = KvIndex(batch.block_size)
        try:
            result = state.table.kv_index.apply(batch)
        except BlockSizeMismatch as exc:
            state.counters["kv_mismatch"] = state.counters.get("kv_mismatch", 0) + 1
            log.error("refusing KV events of %s: %s", batch.worker_id, exc)
            return
        state.counters["kv_batches"] += 1
        state.kv_progress.set()
        if result.gap:
            state.counters["kv_gaps"] += 1
            await request_dump(batch.worker_id)

    @app.task
    async def project_workers() -> None:
        await follow_topic(settings, catalog.workers, on_worker_record, state.workers_caught_up, hot=False)

    async def on_inflight_record(msg) -> None:
        try:
            record = decode(InflightRecord, msg.value)
        except RecordError:
            return  # dead-lettered once by check_inflight
        apply_inflight_record(state.table, record)
        state.counters["inflight_records"] += 1
        if isinstance(record, RequestFinished):
            state.orphans.finished(record.request_id, record.worker_id)

    @app.task
    async def project_inflight() -> None:
        await follow_topic(settings, catalog.inflight, on_inflight_record, state.inflight_caught_up,
                           idle_wait_ms=settings.state_wait_ms, policies=state.projection_waits)

    @app.task
    async def project_kv_events() -> None:
        if uses_events:
            await follow_topic(settings, catalog.kv_events, on_kv_record, state.kv_caught_up,
                               idle_wait_ms=settings.state_wait_ms, policies=state.projection_waits)

    async def request_dump(worker_id: str) -> None:
        ask = KvDumpRequest(worker_id=worker_id, requested_by=router_id, ts_ms=now_ms())
        await app.producer.send(catalog.kv_dump_requests.name, worker_id.encode(), encode(ask), 0, None, None)

    @app.timer(interval=max(0.05, settings.heartbeat_interval_ms / 1000))
    async def housekeeping() -> None:
        now = now_ms()
        expired = expire_workers(state.table, now)
        await answer_lost(expired)
        index = state.table.kv_index
        if isinstance(index, KvIndex):
            for worker_id in expired:
                index.remove_worker(worker_id)
            for worker_id in index.workers_needing_dump():
                if worker_id in state.table.workers:
                    await request_dump(worker_id)
        await release_queued(now)

    @app.agent(requests_topic, name="route_requests")
    async def route_requests(stream: faust.StreamT) -> None:
        async for event in stream.events():
            try:
                request = decode(InferenceRequest, event.value)
            except RecordError as exc:
                await dead_letter(event, str(exc))
                continue
            try:
                await route_one(request)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the router
                log.exception("routing %s failed", request.request_id)
                await dead_letter(event, f"routing failed: {exc!r}")

    async def route_one(request: InferenceRequest) -> None:
        for wait in state.projection_waits:  # traffic: keep the load and cache views fresh
            wait.wake(time.monotonic())
        if not (state.workers_caught_up.is_set() and state.inflight_caught_up.is_set()):
            # First requests after a (re)start: let the table catch up with the log.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(state.workers_caught_up.wait(),
                                                      state.inflight_caught_up.wait()), 5.0)
        if uses_events:
            await wait_for_finished_kv()
        now = now_ms()
        await answer_lost(expire_workers(state.table, now))
        role = decode_role(state.table, request.model)
        candidates = state.table.candidates(request.model, role)
        decision = shed(candidates, shed_config, queued=len(state.queue) if state.queue is not None else 0)
        if decision.action == "reject" and candidates:
            state.counters["shed"] += 1
            reason = f"all workers are busy ({decision.reason})"
            await reply_error(request, reason, status=503, code="overloaded", retry_after_s=decision.retry_after_s)
            await publish_decision(request, DecisionOutcome.shed, role, now, reason=reason)
            return
        if decision.action == "queue":
            try:
                state.queue.push(request, isl=len(request.token_ids or ()), deadline_ms=request.deadline_ms)
                state.counters["queued"] += 1
                await publish_decision(request, DecisionOutcome.queued, role, now,
                                       reason=f"all workers are busy ({decision.reason})")
            except QueueFull:
                state.counters["shed"] += 1
                reason = "all workers are busy and the router queue is full"
                await reply_error(request, reason, status=503, code="overloaded",
                                  retry_after_s=decision.retry_after_s or 1)
                await publish_decision(request, DecisionOutcome.shed, role, now, reason=reason)
            return
        await dispatch(request, role, candidates, decision.candidates, now)

    def kv_cursor(worker_id: str) -> int | None:
        index = state.table.kv_index
        return index.last_event_id(worker_id) if isinstance(index, KvIndex) else None

    async def wait_for_finished_kv() -> None:
        # The index should hold the KV events published before the finish records folded so far.
        lagging = kv_lagging(state.table, kv_cursor, state.table.workers)
        if not lagging:
            return
        state.counters["kv_waits"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + KV_CATCH_UP_S
        while lagging:
            remaining = deadline - loop.time()
            if remaining <= 0:
                state.counters["kv_wait_timeouts"] += 1
                log.warning("KV events of %s not folded within %.0f ms of their finish records; routing without",
                            lagging, KV_CATCH_UP_S * 1000)
                for worker_id in lagging:
                    waive_kv(state.table, worker_id, kv_cursor(worker_id))
                return
            state.kv_progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.kv_progress.wait(), remaining)
            lagging = kv_lagging(state.table, kv_cursor, lagging)

    async def dispatch(request: InferenceRequest, role: WorkerRole, candidates, free, now: int) -> None:
        block_hashes: tuple[int, ...] = ()
        if hashes_needed and request.token_ids and candidates:
            block_hashes = tuple(compute_block_hashes(request.token_ids, candidates[0].block_size, request.lora_name))
        route_req = RouteRequest(
            request_id=request.request_id, model=request.model,
            isl=len(request.token_ids) if request.token_ids else 0, role=role,
            block_hashes=block_hashes, lora_name=request.lora_name, now_ms=request.created_ms or now,
        )
        free_ids = {w.worker_id for w in free}
        state.table.busy = frozenset(w.worker_id for w in candidates if w.worker_id not in free_ids)
        try:
            placement = await route_and_forward(state.policy, request, route_req, state.table, disagg_config,
                                                send_record, router_id=router_id, now_ms=now)
            state.orphans.note(Routed(request.request_id, placement.decision.worker_id,
                                      placement.decision.prefill_worker_id, request.reply_to, request.attempt))
        except NoWorkerAvailable as exc:
            state.counters["rejected"] += 1
            await reply_error(request, str(exc), status=503, code="no_workers")
            await publish_decision(request, DecisionOutcome.rejected, role, now, reason=str(exc))
            return
        finally:
            state.table.busy = frozenset()
        state.counters["routed"] += 1
        await publish_decision(request, DecisionOutcome.routed, role, now, placement=placement)

    def decision_lost(ack: asyncio.Future) -> None:
        if not ack.cancelled() and ack.exception() is not None:
            state.counters["decisions_lost"] += 1
            log.warning("routing decision record not delivered: %r", ack.exception())

    async def publish_decision(request: InferenceRequest, outcome: DecisionOutcome, role: WorkerRole, now: int, *,
                               placement: Placement | None = None, reason: str | None = None) -> None:
        # Built from what the policy computed; sent without waiting for the ack. A record that
        # cannot be built or sent is counted and logged, never retried, and never fails the
        # request: the decision it describes has been carried out already.
        decision = placement.decision if placement is not None else None
        plan = placement.plan if placement is not None else None
        prefill = plan.prefill if plan is not None else None
        try:
            record = DecisionRecord(
                request_id=request.request_id, model=request.model, outcome=outcome, policy=state.policy,
                router_id=router_id, decided_ms=now, isl=len(request.token_ids or ()), role=role, reason=reason,
                worker_id=decision.worker_id if decision is not None else None,
                prefill_worker_id=decision.prefill_worker_id if decision is not None else None,
                prefill_reason=plan.reason if plan is not None and plan.reason != "no_prefill_workers" else None,
                candidates=list(decision.candidates) if decision is not None else [],
                prefill_candidates=list(prefill.candidates) if prefill is not None else [],
            )
            ack = await app.producer.send(catalog.routing_decisions.name, request.request_id.encode(),
                                          encode(record), None, None, None)
        except Exception:  # noqa: BLE001 - the audit record must not fail a routed request
            state.counters["decisions_lost"] += 1
            log.exception("routing decision record of %s not sent", request.request_id)
            return
        state.counters["decisions"] += 1
        if isinstance(ack, asyncio.Future):
            ack.add_done_callback(decision_lost)

    async def release_queued(now: int) -> None:
        queue = state.queue
        if queue is None or not len(queue):
            return
        for expired in queue.pop_expired(now):
            await reply_error(expired, "deadline passed while queued for a free worker", status=504,
                              code="deadline_exceeded")
        released = 0
        while len(queue):
            request = queue.peek()
            role = decode_role(state.table, request.model)
            candidates = state.table.candidates(request.model, role)
            free = [w for w in candidates if w.worker_id not in state.table.busy]
            if not has_free_worker(candidates, shed_config) or released >= len(candidates):
                break
            queue.pop()
            released += 1
            decision = shed(candidates, shed_config)
            await dispatch(request, role, candidates, decision.candidates or free, now)

    async def answer_lost(gone: list[str]) -> None:
        for routed in state.orphans.take_lost(gone):
            state.counters["worker_lost"] += 1
            log.warning("worker of %s expired before finishing it; answering worker_lost", routed.request_id)
            await send_error(routed.request_id, routed.reply_to, routed.attempt,
                             f"worker {routed.worker_id} stopped responding before the request finished",
                             status=503, code="worker_lost", retry_after_s=1, worker_id=routed.worker_id)

    async def send_record(topic: str, partition: int, key: bytes, value: bytes) -> None:
        await app.producer.send(topic, key, value, partition, None, None)

    async def reply_error(request: InferenceRequest, message: str, *, status: int, code: str,
                          retry_after_s: int | None = None) -> None:
        await send_error(request.request_id, request.reply_to, request.attempt, message, status=status, code=code,
                         retry_after_s=retry_after_s)

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
