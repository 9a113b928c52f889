"""The routing table: live workers, derived from worker heartbeat records.

Pure state and pure update functions, so the Faust router, its replicas and
the offline simulator build identical tables from the same records. Time is
passed in (``now_ms``), never read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.schemas import WorkerHeartbeat, WorkerRole, WorkerStatus

__all__ = ["WorkerView", "RoutingTable", "apply_heartbeat", "expire_workers", "note_routed"]


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker (from its last heartbeat).

    ``routed_since_heartbeat`` counts requests this router sent the worker
    after that heartbeat; least-loaded adds it to the reported load so a
    burst between heartbeats is spread out.
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
    """Live workers by id, the round-robin cursor per (model, role), and the
    KV index that KV-aware policies consult (``None`` until one is attached)."""

    workers: dict[str, WorkerView] = field(default_factory=dict)
    rr_cursor: dict[tuple[str, str], int] = field(default_factory=dict)
    kv_index: Any = None
    kv_config: Any = None
    """Weights of the ``kv``/``approx`` cost (a :class:`~kvflow.router.kv_policy.KvPolicyConfig`);
    None = the policy's own (the defaults)."""
    busy: frozenset[str] = frozenset()
    """Workers load shedding marked busy for the decision at hand (never candidates)."""

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
    """Fold one heartbeat into the table. A ``stopped`` worker is removed.

    Heartbeats older than the one held (by ``ts_ms``) are ignored, so replays
    and reordering cannot resurrect a stale view.
    """
    held = table.workers.get(hb.worker_id)
    if held is not None and hb.ts_ms < held.last_seen_ms:
        return
    if hb.status == WorkerStatus.stopped:
        table.workers.pop(hb.worker_id, None)
        return
    table.workers[hb.worker_id] = WorkerView.from_heartbeat(hb)


def expire_workers(table: RoutingTable, now_ms: int) -> list[str]:
    """Drop workers whose last heartbeat is older than their TTL; returns their ids."""
    gone = [w.worker_id for w in table.workers.values() if now_ms - w.last_seen_ms > w.ttl_ms]
    for worker_id in gone:
        del table.workers[worker_id]
    return gone


def note_routed(table: RoutingTable, worker_id: str) -> None:
    """Count a request sent to ``worker_id`` since its last heartbeat."""
    w = table.workers.get(worker_id)
    if w is not None:
        table.workers[worker_id] = replace(w, routed_since_heartbeat=w.routed_since_heartbeat + 1)
