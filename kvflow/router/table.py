"""The routing table: live workers, derived from worker heartbeat records.

Pure state and pure update functions, so the Faust router, its replicas and
the offline simulator build identical tables from the same records. Time is
passed in (``now_ms``), never read here. Which workers are live is the
workers projection every reader of the workers topic shares
(:class:`kvflow.streams.workers.Workers`); the table adds what only the
router knows.

Each worker's load figures are its heartbeat's, reconciled with the
requests it took and ended since (the inflight topic, folded by
:mod:`kvflow.router.inflight` into :attr:`RoutingTable.inflight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.router.inflight import InflightTracker, expire_inflight, forget_worker, observe_heartbeat, refresh_view
from kvflow.schemas import WorkerHeartbeat, WorkerRole, WorkerStatus
from kvflow.streams.workers import Workers, WorkerView

__all__ = ["WorkerView", "RoutingTable", "apply_heartbeat", "expire_workers", "note_routed"]


@dataclass
class RoutingTable:
    """Live workers (:attr:`live`, by id in :attr:`workers`), the round-robin
    cursor per (model, role), the KV index that KV-aware policies consult
    (``None`` until one is attached), and the requests each worker holds
    (:attr:`inflight`)."""

    live: Workers = field(default_factory=Workers)
    """The workers projection (:mod:`kvflow.streams.workers`); its views carry the reconciled load."""
    rr_cursor: dict[tuple[str, str], int] = field(default_factory=dict)
    kv_index: Any = None
    kv_config: Any = None
    """Weights of the ``kv``/``approx`` cost (a :class:`~kvflow.router.kv_policy.KvPolicyConfig`);
    None = the policy's own (the defaults)."""
    busy: frozenset[str] = frozenset()
    """Workers load shedding marked busy for the decision at hand (never candidates)."""
    pools: tuple[str, str] | None = None
    """(prefill pool, pool of every other role) of the decision at hand: only
    their workers are candidates (:mod:`kvflow.router.pools`); None = every pool."""
    inflight: InflightTracker = field(default_factory=InflightTracker)
    """Requests routed to, taken and ended by each worker (:mod:`kvflow.router.inflight`)."""

    @property
    def workers(self) -> dict[str, WorkerView]:
        """Live workers' views by id (the projection's own dict, not a copy)."""
        return self.live.views

    def candidates(self, model: str, role: WorkerRole | str) -> list[WorkerView]:
        """Serving, non-busy workers of ``model`` and ``role`` (in the decision's pool,
        :attr:`pools`), sorted by worker id (stable order)."""
        role = WorkerRole(role)
        found = (w for w in self.workers.values()
                 if w.model == model and w.role == role and w.status == WorkerStatus.serving
                 and w.worker_id not in self.busy)
        if self.pools is not None:
            pool = self.pools[0] if role is WorkerRole.prefill else self.pools[1]
            found = (w for w in found if w.pool == pool)
        return sorted(found, key=lambda w: w.worker_id)

    def models(self) -> list[str]:
        """Models served by at least one serving worker."""
        return sorted({w.model for w in self.workers.values() if w.status == WorkerStatus.serving})

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-friendly list of workers (for status pages)."""
        return self.live.snapshot()


def apply_heartbeat(table: RoutingTable, hb: WorkerHeartbeat) -> None:
    """Fold one heartbeat into the table. A ``stopped`` worker is removed
    (with its in-flight entries).

    Heartbeats older than the one held (by ``ts_ms``) are ignored, so replays
    and reordering cannot resurrect a stale view. The new view's load
    figures are reconciled with the worker's in-flight entries
    (:func:`kvflow.router.inflight.observe_heartbeat`).
    """
    if not table.live.apply(hb):
        return
    if hb.status == WorkerStatus.stopped:
        forget_worker(table, hb.worker_id)
        return
    observe_heartbeat(table, hb)
    refresh_view(table, hb.worker_id)


def expire_workers(table: RoutingTable, now_ms: int) -> list[str]:
    """Drop workers whose last heartbeat is older than their TTL, with their
    in-flight entries, and expire provisional entries never taken
    (:func:`kvflow.router.inflight.expire_inflight`); returns the dropped worker ids."""
    gone = table.live.expire(now_ms)
    for worker_id in gone:
        forget_worker(table, worker_id)
    expire_inflight(table, now_ms)
    return gone


def note_routed(table: RoutingTable, worker_id: str) -> None:
    """Count a request sent to ``worker_id`` since its last heartbeat (the
    fallback for workers that publish no inflight records; the router uses
    :func:`kvflow.router.inflight.note_routed_request`, which falls back to this)."""
    w = table.workers.get(worker_id)
    if w is not None:
        table.workers[worker_id] = replace(w, routed_since_heartbeat=w.routed_since_heartbeat + 1)
