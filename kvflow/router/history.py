"""The global KV index as it was at a past time, rebuilt from the log (``kvflow index --at``).

A router's index is a fold of two topics: KV event batches (kv-events) and
heartbeats (workers: a stopped or restarted worker loses its blocks, a
silent one expires). :func:`index_at` replays both, merged in time order,
into a fresh :class:`~kvflow.router.core.RouterCore` with the ``kv`` policy,
the same code the live router folds them with, keeping only records
stamped (their ``ts_ms``, set by the worker when it published them) at or
before ``at_ms``. Expiry is ticked on the records' own clock, once per
heartbeat interval and at ``at_ms``.

The result equals a live router's index at ``at_ms`` when that router had
folded everything published by then (a router lagging behind its
``kvflow_router_kv_event_apply_lag_seconds`` held less).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvflow.router.core import RouterCore
from kvflow.router.index import KvIndex
from kvflow.schemas import KvEventBatch, KvWireBatch, RecordError, WorkerHeartbeat, decode, decode_kv_frame
from kvflow.schemas.block_hash import BlockSizeMismatch
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.history import read_topic

__all__ = ["IndexAt", "index_at", "fold_index"]

log = logging.getLogger(__name__)


@dataclass
class IndexAt:
    """An index rebuilt at ``at_ms``: the index (None: no KV batch by then),
    and how many heartbeats and KV batches were folded and skipped (after ``at_ms``)."""

    at_ms: int
    index: KvIndex | None
    heartbeats: int
    kv_batches: int
    skipped_later: int

    def summary(self) -> dict:
        """JSON-friendly counts: blocks per worker (device tier) and the fold's figures."""
        workers = {}
        if self.index is not None:
            workers = {w: self.index.num_blocks(w) for w in self.index.workers()}
        return {"at_ms": self.at_ms, "block_size": self.index.block_size if self.index is not None else None,
                "blocks": workers, "total_blocks": sum(workers.values()), "heartbeats": self.heartbeats,
                "kv_batches": self.kv_batches, "skipped_later": self.skipped_later}


def fold_index(heartbeats: list[WorkerHeartbeat], batches: list[KvEventBatch | KvWireBatch], at_ms: int, *,
               tick_interval_ms: int = 1000) -> IndexAt:
    """Fold ``heartbeats`` and KV ``batches`` stamped at or before ``at_ms`` (epoch ms),
    in time order (a heartbeat before a batch of the same ms), into a ``kv`` router core."""
    core = RouterCore("kv")
    timeline = sorted([(hb.ts_ms, 0, i) for i, hb in enumerate(heartbeats)]
                      + [(b.ts_ms, 1, i) for i, b in enumerate(batches)])
    folded_hb = folded_kv = later = 0
    next_tick = None
    for ts, kind, i in timeline:
        if ts > at_ms:
            later += 1
            continue
        if next_tick is not None and ts >= next_tick:
            core.tick(ts)  # silent workers expire as they would have live
        next_tick = ts + tick_interval_ms if next_tick is None or ts >= next_tick else next_tick
        if kind == 0:
            core.on_heartbeat(heartbeats[i])
            folded_hb += 1
        else:
            try:
                core.on_kv_batch(batches[i])
                folded_kv += 1
            except BlockSizeMismatch as exc:
                log.error("skipping KV events of %s: %s", batches[i].worker_id, exc)
    core.tick(at_ms)
    return IndexAt(at_ms, core.table.kv_index, folded_hb, folded_kv, later)


async def index_at(settings: Settings, at_ms: int, catalog: Catalog | None = None, *,
                   progress: bool = False) -> IndexAt:
    """Read the workers and kv-events topics whole and fold them up to ``at_ms``
    (see the module doc). Malformed records are skipped, as the router skips them.
    ``progress``: report records read on stderr.

    Raises:
        aiokafka.errors.KafkaError: the broker cannot be reached.
        TimeoutError: a topic could not be read whole.
    """
    catalog = catalog or Catalog(settings.namespace)
    heartbeats, batches = [], []
    for msg in await read_topic(settings, catalog.workers, progress=progress):
        try:
            heartbeats.append(decode(WorkerHeartbeat, msg.value))
        except RecordError:
            continue
    for msg in await read_topic(settings, catalog.kv_events, progress=progress):
        try:
            batches.append(decode_kv_frame(msg.value))
        except RecordError:
            continue
    return fold_index(heartbeats, batches, at_ms, tick_interval_ms=settings.heartbeat_interval_ms)
