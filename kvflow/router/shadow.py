"""A shadow router: decide every live request with another policy, act on nothing, compare.

:class:`ShadowRouter` folds the same topics a live router folds (workers,
kv-events, inflight) into its own
:class:`~kvflow.router.core.RouterCore` with the shadow policy, reads the
requests topic (assigned, no consumer group: the live router's group keeps
every request) and asks the core what it would do with each one
(:meth:`~kvflow.router.core.RouterCore.evaluate`: nothing is counted,
queued or sent). It then reads the live router's decision records
(routing-decisions topic) and pairs them by request id.

For each pair it scores both choices on one global KV index, its own, fed
from the kv-events topic whatever the shadow policy: the prompt blocks the
chosen worker already held when the shadow decided. The tally
(:class:`ShadowTally`) gives the agreement (same worker) and the predicted
prefix hit ratio of each router, overlap blocks / prompt blocks, so
``shadow - live`` predicts what switching policy would change. The
prediction ignores what the choice itself changes later (the cache the
request leaves, the load it adds).

The shadow core's load view is the live router's: the in-flight requests
workers report (inflight topic and heartbeats) plus the requests the live
router's decision records routed and no worker has taken yet. It reads
those records a little later than the live router wrote them, so under
bursts it can see less load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry, Counter

from kvflow.router.core import Arrival, RouterCore
from kvflow.router.disagg import DisaggConfig
from kvflow.router.index import KvIndex
from kvflow.router.inflight import note_routed_request
from kvflow.router.kv_policy import KvPolicyConfig
from kvflow.router.shedding import ShedConfig
from kvflow.schemas import (
    DecisionOutcome,
    DecisionRecord,
    InferenceRequest,
    InflightRecord,
    RecordError,
    RequestFinished,
    WorkerHeartbeat,
    decode,
    decode_kv_frame,
    now_ms,
)
from kvflow.schemas.block_hash import BlockSizeMismatch, compute_block_hashes
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import adapt_fetch_wait, make_consumer

__all__ = ["ShadowRouter", "ShadowTally", "PENDING_LIMIT"]

log = logging.getLogger(__name__)

PENDING_LIMIT = 10_000
"""Requests (or live decisions) held while waiting for their other half, oldest dropped first."""


@dataclass
class ShadowTally:
    """Running comparison of the shadow's choices with the live router's.

    ``compared``: routed requests both routers decided; ``agreed``: the same
    worker; ``prompt_blocks``: their full prompt blocks; ``live_overlap_blocks``
    / ``shadow_overlap_blocks``: blocks the chosen worker already held, per
    router; ``shadow_unrouted``: live-routed requests the shadow had no worker for.
    """

    compared: int = 0
    agreed: int = 0
    prompt_blocks: int = 0
    live_overlap_blocks: int = 0
    shadow_overlap_blocks: int = 0
    shadow_unrouted: int = 0

    def summary(self) -> dict:
        """JSON-friendly figures: counts, agreement and predicted hit ratios (None before any comparison)."""
        blocks = self.prompt_blocks
        live = self.live_overlap_blocks / blocks if blocks else None
        shadow = self.shadow_overlap_blocks / blocks if blocks else None
        return {"compared": self.compared, "agreement": self.agreed / self.compared if self.compared else None,
                "live_predicted_hit_ratio": live, "shadow_predicted_hit_ratio": shadow,
                "hit_ratio_difference": shadow - live if blocks else None,
                "shadow_unrouted": self.shadow_unrouted}


@dataclass
class _Verdict:
    worker_id: str | None
    overlaps: dict[str, int]
    prompt_blocks: int


@dataclass
class ShadowRouter:
    """Shadow-route a deployment's live requests with ``policy`` (see the module doc).

    ``await run()`` until cancelled; :attr:`ready` is set once the shadow
    has folded the topics' history and is positioned at the end of the
    requests and routing-decisions topics.
    """

    settings: Settings
    policy: str
    catalog: Catalog | None = None
    tally: ShadowTally = field(default_factory=ShadowTally)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.catalog = self.catalog or Catalog(self.settings.namespace)
        s = self.settings
        self.core = RouterCore(self.policy, kv=KvPolicyConfig.from_settings(s), shed=ShedConfig.from_settings(s),
                               disagg=DisaggConfig.from_settings(s), router_id=f"shadow-{uuid.uuid4().hex[:8]}")
        self.index: KvIndex | None = None  # scores both routers' choices, whatever the policy
        self._verdicts: OrderedDict[str, _Verdict] = OrderedDict()
        self._live: OrderedDict[str, DecisionRecord] = OrderedDict()
        self._started: dict[str, int] = {}  # worker id -> started_ms of its latest heartbeat
        self.registry = CollectorRegistry()
        self._compared = Counter("kvflow_shadow_compared", "Routed requests the shadow router compared, by "
                                 "agreement with the live router.", ["policy", "agree"], registry=self.registry)
        self._overlap = Counter("kvflow_shadow_overlap_blocks", "Prompt blocks the chosen worker held, by "
                                "router (live, shadow).", ["policy", "router"], registry=self.registry)
        self._prompt = Counter("kvflow_shadow_prompt_blocks", "Full prompt blocks of the compared requests.",
                               ["policy"], registry=self.registry)

    # ---- the log, folded ------------------------------------------------------

    async def _on_worker(self, msg) -> None:
        try:
            hb = decode(WorkerHeartbeat, msg.value)
        except RecordError:
            return
        self.core.on_heartbeat(hb)
        # The scoring index forgets a stopped or restarted worker's blocks, as the core's does.
        wid = hb.worker_id
        gone = wid not in self.core.table.workers
        restarted = self._started.get(wid, hb.started_ms) != hb.started_ms
        if gone:
            self._started.pop(wid, None)
        else:
            self._started[wid] = hb.started_ms
        if (gone or restarted) and self.index is not None:
            self.index.remove_worker(wid)

    async def _on_kv(self, msg) -> None:
        try:
            batch = decode_kv_frame(msg.value)
        except RecordError:
            return
        if self.index is None:
            self.index = KvIndex(batch.block_size)
        try:
            self.index.apply(batch)
            if self.core.uses_events:
                self.core.on_kv_batch(decode_kv_frame(msg.value))  # its own view of the bytes
        except BlockSizeMismatch as exc:
            log.error("refusing KV events of %s: %s", batch.worker_id, exc)

    async def _on_inflight(self, msg) -> None:
        with contextlib.suppress(RecordError):
            record = decode(InflightRecord, msg.value)
            if isinstance(record, RequestFinished):
                self.core.on_request_finished(record)
            else:
                self.core.on_request_admitted(record)

    # ---- requests and live decisions -------------------------------------------

    def on_request(self, request: InferenceRequest) -> None:
        """Decide ``request`` in the shadow (nothing is sent) and compare if its live decision is in."""
        placement = self.core.evaluate(Arrival.of(request), now_ms())
        overlaps: dict[str, int] = {}
        prompt_blocks = 0
        if self.index is not None and request.token_ids:
            hashes = compute_block_hashes(request.token_ids, self.index.block_size, request.lora_name,
                                          request.mm_hashes(self.index.block_size))
            prompt_blocks = len(hashes)
            overlaps = dict(self.index.find_matches(hashes).device)
        verdict = _Verdict(placement.decision.worker_id if placement is not None else None, overlaps, prompt_blocks)
        live = self._live.pop(request.request_id, None)
        if live is not None:
            self._compare(verdict, live)
        else:
            _bounded_put(self._verdicts, request.request_id, verdict)

    def on_decision(self, record: DecisionRecord) -> None:
        """Count a live routing decision on its workers (as the live router counts what it
        routed until the worker takes it), and pair it with the shadow's verdict (held
        until the verdict comes)."""
        if record.outcome is not DecisionOutcome.routed or not record.worker_id:
            return
        self._count_live(record)
        verdict = self._verdicts.pop(record.request_id, None)
        if verdict is not None:
            self._compare(verdict, record)
        else:
            _bounded_put(self._live, record.request_id, record)

    def _count_live(self, record: DecisionRecord) -> None:
        """The load the live router added with ``record``, in the shadow's table
        (what :func:`~kvflow.router.disagg.count_placement` counts for a decision)."""
        table = self.core.table
        decode = table.workers.get(record.worker_id)
        if decode is None:
            return
        rid, isl, at = record.request_id, record.isl, record.decided_ms
        if record.prefill_worker_id:  # remote prefill: the prefill worker computes it all, decode imports
            note_routed_request(table, record.prefill_worker_id, rid, prompt_tokens=isl, prefill_tokens=isl,
                                now_ms=at)
            note_routed_request(table, record.worker_id, rid, prompt_tokens=isl, prefill_tokens=0, now_ms=at)
            return
        overlap = next((c.overlap_blocks for c in record.candidates if c.worker_id == record.worker_id), 0)
        note_routed_request(table, record.worker_id, rid, prompt_tokens=isl,
                            prefill_tokens=isl - overlap * decode.block_size, now_ms=at)

    def _compare(self, verdict: _Verdict, live: DecisionRecord) -> None:
        t = self.tally
        t.compared += 1
        if verdict.worker_id is None:
            t.shadow_unrouted += 1
        agree = verdict.worker_id == live.worker_id
        t.agreed += agree
        live_overlap = verdict.overlaps.get(live.worker_id, 0)
        shadow_overlap = verdict.overlaps.get(verdict.worker_id, 0) if verdict.worker_id else 0
        t.prompt_blocks += verdict.prompt_blocks
        t.live_overlap_blocks += live_overlap
        t.shadow_overlap_blocks += shadow_overlap
        self._compared.labels(self.policy, str(agree).lower()).inc()
        self._overlap.labels(self.policy, "live").inc(live_overlap)
        self._overlap.labels(self.policy, "shadow").inc(shadow_overlap)
        self._prompt.labels(self.policy).inc(verdict.prompt_blocks)

    # ---- running ---------------------------------------------------------------

    async def run(self) -> None:
        """Fold the topics and shadow every new request until cancelled.

        One consumer reads the workers, kv-events, inflight, routing-decisions
        and requests topics from their beginning and handles the records of
        each fetch in the order they were produced (record timestamps; the
        producers share this machine's clock or a synchronised one), so a
        request is decided on the state its live router could have seen: the
        records published before it, the live router's earlier decisions
        included, and not its own decision. Requests and decisions already in
        the log when the shadow starts are skipped (:attr:`ready` is set after
        the first fetch that returns nothing).

        Raises:
            aiokafka.errors.KafkaError: the broker cannot be reached at start.
        """
        catalog = self.catalog
        handlers = {catalog.workers.name: self._on_worker, catalog.kv_events.name: self._on_kv,
                    catalog.inflight.name: self._on_inflight,
                    catalog.routing_decisions.name: self._on_decision_record,
                    catalog.requests.name: self._on_request_record}
        rank = {topic: i for i, topic in enumerate(handlers)}  # ties: state first, then decisions, requests
        specs = (catalog.workers, catalog.kv_events, catalog.inflight, catalog.routing_decisions, catalog.requests)
        consumer = make_consumer(self.settings, auto_offset_reset="earliest")
        await consumer.start()
        adapt_fetch_wait(consumer, self.settings, {catalog.requests.name, catalog.routing_decisions.name,
                                                   catalog.kv_events.name, catalog.inflight.name}.__contains__)
        try:
            tps = [TopicPartition(spec.name, p) for spec in specs for p in range(spec.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while True:
                batches = await consumer.getmany(timeout_ms=200 if not self.ready.is_set() else 1000,
                                                 max_records=5000)
                if not batches and not self.ready.is_set():
                    self.ready.set()
                records = sorted((msg for part in batches.values() for msg in part),
                                 key=lambda m: (m.timestamp, rank[m.topic]))
                for msg in records:
                    try:
                        await handlers[msg.topic](msg)
                    except Exception:  # noqa: BLE001 - one record must not stop the shadow
                        log.exception("shadow failed on %s[%d]@%d", msg.topic, msg.partition, msg.offset)
        finally:
            await consumer.stop()

    async def _on_request_record(self, msg) -> None:
        if not self.ready.is_set():
            return  # history: decided long ago, on a state the shadow never saw
        with contextlib.suppress(RecordError):
            self.on_request(decode(InferenceRequest, msg.value))

    async def _on_decision_record(self, msg) -> None:
        if not self.ready.is_set():
            return
        with contextlib.suppress(RecordError):
            self.on_decision(decode(DecisionRecord, msg.value))


def _bounded_put(held: OrderedDict, key: str, value: object) -> None:
    held[key] = value
    while len(held) > PENDING_LIMIT:
        held.popitem(last=False)
