"""The routing table: live workers, derived from worker heartbeat records.

Pure state and pure update functions, so the Faust router, its replicas and
the offline simulator build identical tables from the same records. Time is
passed in (``now_ms``), never read here.

Each worker's load figures are its heartbeat's, reconciled with the
requests it took and ended since (the inflight topic, folded by
:mod:`kvflow.router.inflight` into :attr:`RoutingTable.inflight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.router.inflight import InflightTracker, expire_inflight, forget_worker, observe_heartbeat, refresh_view
from kvflow.schemas import WorkerHeartbeat, WorkerRole, WorkerStatus

__all__ = ["WorkerView", "RoutingTable", "apply_heartbeat", "expire_workers", "note_routed"]


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker (from its last heartbeat).

    ``active_requests``, ``waiting_requests`` and ``active_prefill_tokens``
    (tokens) are the heartbeat's figures; for a worker publishing inflight
    records they are reconciled with what it ended since (requests that
    ended no longer count; :mod:`kvflow.router.inflight`).

    ``routed_since_heartbeat`` counts requests on the worker that the
    heartbeat's figures leave out: for a tracked worker, exactly the
    requests it took after the heartbeat plus those this router sent and
    it has not taken yet, less those that ended; otherwise, the requests
    this router sent after the heartbeat. Least-loaded adds it to the
    reported load so a burst between heartbeats is spread out.
    ``routed_prefill_tokens`` is the prompt tokens those requests are
    expected to compute (tracked workers), or None (unknown: the cost
    assumes each is as large as the request being routed).
    """

    worker_id: str
    role: WorkerRole
    model: str
    block_size: int
    kv_total_blocks: int
    kv_used_blocks: int
    active_requests: int
    waiting_requests: int
    active_prefill_tokens: int
    queue_topic: str
    queue_partition: int
    status: WorkerStatus
    last_seen_ms: int
    ttl_ms: int
    routed_since_heartbeat: int = 0
    routed_prefill_tokens: int | None = None

    @property
    def load(self) -> int:
        """In-flight requests: reported active + waiting + routed since."""
        return self.active_requests + self.waiting_requests + self.routed_since_heartbeat

    @classmethod
    def from_heartbeat(cls, hb: WorkerHeartbeat) -> "WorkerView":
        """Build a view from a heartbeat record."""
        return cls(
            worker_id=hb.worker_id, role=hb.role, model=hb.model, block_size=hb.block_size,
            kv_total_blocks=hb.kv_total_blocks, kv_used_blocks=hb.kv_used_blocks,
            active_requests=hb.active_requests, waiting_requests=hb.waiting_requests,
            active_prefill_tokens=hb.active_prefill_tokens, queue_topic=hb.queue_topic,
            queue_partition=hb.queue_partition, status=hb.status, last_seen_ms=hb.ts_ms, ttl_ms=hb.ttl_ms,
        )


@dataclass
class RoutingTable:
    """Live workers by id, the round-robin cursor per (model, role), the
    KV index that KV-aware policies consult (``None`` until one is attached),
    and the requests each worker holds (:attr:`inflight`)."""

    workers: dict[str, WorkerView] = field(default_factory=dict)
    rr_cursor: dict[tuple[str, str], int] = field(default_factory=dict)
    kv_index: Any = None
    kv_config: Any = None
    """Weights of the ``kv``/``approx`` cost (a :class:`~kvflow.router.kv_policy.KvPolicyConfig`);
    None = the policy's own (the defaults)."""
    busy: frozenset[str] = frozenset()
    """Workers load shedding marked busy for the decision at hand (never candidates)."""
    inflight: InflightTracker = field(default_factory=InflightTracker)
    """Requests routed to, taken and ended by each worker (:mod:`kvflow.router.inflight`)."""

    def candidates(self, model: str, role: WorkerRole | str) -> list[WorkerView]:
        """Serving, non-busy workers of ``model`` and ``role``, sorted by worker id (stable order)."""
        role = WorkerRole(role)
        return sorted(
            (w for w in self.workers.values()
             if w.model == model and w.role == role and w.status == WorkerStatus.serving
            and w.worker_id not in self.busy),
            key=lambda w: w.worker_id,
        )

    def models(self) -> list[str]:
        """Models served by at least one serving worker."""
        return sorted({w.model for w in self.workers.values() if w.status == WorkerStatus.serving})

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-friendly list of workers (for status pages)."""
        return [
            {**{k: getattr(w, k) for k in w.__dataclass_fields__}, "role": w.role.value, "status": w.status.value}
            for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
        ]


def apply_heartbeat(table: RoutingTable, hb: WorkerHeartbeat) -> None:
    """Fold one heartbeat into the table. A ``stopped`` worker is removed
    (with its in-flight entries).

    Heartbeats older than the one held (by ``ts_ms``) are ignored, so replays
    and reordering cannot resurrect a stale view. The new view's load
    figures are reconciled with the worker's in-flight entries
    (:func:`kvflow.router.inflight.observe_heartbeat`).
    """
    held = table.workers.get(hb.worker_id)
    if held is not None and hb.ts_ms < held.last_seen_ms:
        return
    if hb.status == WorkerStatus.stopped:
        table.workers.pop(hb.worker_id, None)
        forget_worker(table, hb.worker_id)
        return
    table.workers[hb.worker_id] = WorkerView.from_heartbeat(hb)
    observe_heartbeat(table, hb)
    refresh_view(table, hb.worker_id)


def expire_workers(table: RoutingTable, now_ms: int) -> list[str]:
    """Drop workers whose last heartbeat is older than their TTL, with their
    in-flight entries, and expire provisional entries never taken
    (:func:`kvflow.router.inflight.expire_inflight`); returns the dropped worker ids."""
    gone = [w.worker_id for w in table.workers.values() if now_ms - w.last_seen_ms > w.ttl_ms]
    for worker_id in gone:
        del table.workers[worker_id]
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
