"""A router's Prometheus series (``kvflow_router_*``), one registry per router app.

Counted as the router works (:class:`RouterExporter`): decisions by policy,
outcome and worker; the chosen worker's overlap (prompt blocks already in
its KV cache); how long a decision took; and the KV-event apply lag, the
time from a worker publishing a KV event batch (its ``ts_ms``) to this
router folding it into its index, which bounds how stale the index a
decision reads can be.

Read at each scrape (:class:`_RouterCollector`): blocks in the KV index per
worker, live workers by status, requests held in the router's queue
(``shed_mode=queue``), and the core's event counters
(:data:`kvflow.router.core.COUNTERS` and the app's) as
``kvflow_router_events_total{event}``.

Every series carries ``router_id``, so replicas' scrapes merge without collisions.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvflow.router.index import KvIndex
from kvflow.schemas import DecisionOutcome

if TYPE_CHECKING:
    from kvflow.router.app import RouterApp
    from kvflow.router.core import Decision

__all__ = ["RouterExporter"]

# Overlap in blocks: 0, then powers of 2 up to 2048 blocks (32k tokens at 16 tokens a block).
_OVERLAP_BUCKETS = (0.0, *(float(2**k) for k in range(12)))
# Apply lag: a fetch on a quiet broker (ms) to a router that fell behind (tens of s).
_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DECIDE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterExporter:
    """The Prometheus registry of one router app."""

    def __init__(self, router_id: str, policy: str) -> None:
        self.router_id, self.policy = router_id, policy
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvflow_router_decisions", "Routing decisions by policy, outcome (routed, "
                                 "queued, shed, rejected) and chosen worker (empty unless routed).",
                                 ["router_id", "policy", "outcome", "worker_id"], registry=r)
        self.overlap = Histogram("kvflow_router_overlap_blocks", "Prompt blocks the chosen worker already "
                                 "held (routed requests).", ["router_id", "policy"], buckets=_OVERLAP_BUCKETS,
                                 registry=r)
        self.decide = Histogram("kvflow_router_decision_seconds", "Time to decide one request (KV catch-up "
                                "wait included).", ["router_id"], buckets=_DECIDE_BUCKETS_S, registry=r)
        self.kv_lag = Histogram("kvflow_router_kv_event_apply_lag_seconds", "KV event batch publish (its "
                                "ts_ms) to fold into this router's index.", ["router_id"],
                                buckets=_LAG_BUCKETS_S, registry=r)

    def attach(self, router: RouterApp) -> None:
        """Add the scrape-time series read from ``router`` (call once)."""
        self.registry.register(_RouterCollector(router))

    def on_decision(self, decision: Decision) -> None:
        """Count one decision (any outcome)."""
        worker = ""
        if decision.outcome is DecisionOutcome.routed and decision.placement is not None:
            chosen = decision.placement.decision
            worker = chosen.worker_id
            self.overlap.labels(self.router_id, self.policy).observe(chosen.overlap_blocks)
        self.decisions.labels(self.router_id, self.policy, decision.outcome.value, worker).inc()

    def on_kv_batch(self, published_ms: int, folded_ms: int) -> None:
        """A KV event batch published at ``published_ms`` was folded at ``folded_ms`` (epoch ms)."""
        self.kv_lag.labels(self.router_id).observe(max(0, folded_ms - published_ms) / 1000)


class _RouterCollector(Collector):
    def __init__(self, router: RouterApp) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        router = self.router
        rid = router.router_id
        blocks = GaugeMetricFamily("kvflow_router_index_blocks", "Device-tier KV blocks the router's global "
                                   "index holds, per worker.", labels=["router_id", "worker_id"])
        index = router.table.kv_index
        if isinstance(index, KvIndex):
            for worker_id in sorted(index.workers()):
                blocks.add_metric([rid, worker_id], float(index.num_blocks(worker_id)))
        yield blocks
        workers = GaugeMetricFamily("kvflow_router_workers", "Live workers in the routing table, by role and "
                                    "status.", labels=["router_id", "role", "status"])
        for (role, status), n in sorted(Tally((w.role.value, w.status.value)
                                              for w in router.table.workers.values()).items()):
            workers.add_metric([rid, role, status], float(n))
        yield workers
        queued = GaugeMetricFamily("kvflow_router_queued_requests", "Requests held in the router's queue "
                                   "(shed_mode=queue).", labels=["router_id"])
        queued.add_metric([rid], float(len(router.queue)) if router.queue is not None else 0.0)
        yield queued
        events = CounterMetricFamily("kvflow_router_events", "Router event counts: decisions by outcome, KV "
                                     "batches folded and skipped, dead letters, workers expired ...",
                                     labels=["router_id", "event"])
        for name, value in sorted(router.counters.items()):
            events.add_metric([rid, name], float(value))
        yield events
