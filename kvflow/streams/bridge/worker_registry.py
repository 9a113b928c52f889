"""The bridge's own projection of live workers, built from the workers topic.

The bridge answers ``/v1/models``, 404 (unknown model) and 503 (no live
worker) without asking the router: it folds every heartbeat into a
:class:`~kvflow.router.table.RoutingTable` with the same pure functions the
router uses, and remembers each worker's advertised tokenizer spec.
:func:`follow_workers` is the consumer loop that feeds it (all partitions
assigned, read from the beginning so a fresh bridge sees every worker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvflow.router.table import RoutingTable, WorkerView, apply_heartbeat, expire_workers
from kvflow.schemas import RecordError, WorkerHeartbeat, WorkerStatus, decode, now_ms
from kvflow.streams.catalog import Catalog

__all__ = ["ModelState", "WorkerRegistry", "assign_workers_topic", "catch_up", "follow_workers"]

log = logging.getLogger(__name__)


class ModelState(str, Enum):
    """Whether the bridge can send a request for a model right now.

    ``serving``: at least one serving worker. ``unavailable``: the model was
    seen (some worker served it since this bridge started) but none serves it
    now → 503. ``unknown``: never seen → 404.
    """

    serving = "serving"
    unavailable = "unavailable"
    unknown = "unknown"


@dataclass
class WorkerRegistry:
    """Live workers by id, their tokenizer specs, and every model seen.

    ``clock`` returns epoch ms; workers silent longer than their ``ttl_ms``
    are expired lazily on every read, so answers never rely on a timer task.
    ``models_seen`` maps model → epoch seconds of its first heartbeat (the
    ``created`` field of ``/v1/models``). ``context_lengths`` maps worker id
    → the context length (tokens) its last heartbeat advertised, for the
    workers that advertise one.
    """

    clock: Callable[[], int] = now_ms
    table: RoutingTable = field(default_factory=RoutingTable)
    tokenizer_specs: dict[str, str] = field(default_factory=dict)
    models_seen: dict[str, int] = field(default_factory=dict)
    context_lengths: dict[str, int] = field(default_factory=dict)

    def apply(self, hb: WorkerHeartbeat) -> None:
        """Fold one heartbeat in (stale ones are ignored, ``stopped`` removes)."""
        apply_heartbeat(self.table, hb)
        if hb.worker_id in self.table.workers:
            if self.table.workers[hb.worker_id].last_seen_ms == hb.ts_ms:
                self.tokenizer_specs[hb.worker_id] = hb.tokenizer
                if hb.context_length is None:
                    self.context_lengths.pop(hb.worker_id, None)
                else:
                    self.context_lengths[hb.worker_id] = hb.context_length
        else:
            self._forget(hb.worker_id)
        self.models_seen.setdefault(hb.model, hb.ts_ms // 1000)

    def live_workers(self) -> list[WorkerView]:
        """Serving workers after expiring the silent ones, sorted by id."""
        for worker_id in expire_workers(self.table, self.clock()):
            self._forget(worker_id)
        return sorted((w for w in self.table.workers.values() if w.status == WorkerStatus.serving),
                      key=lambda w: w.worker_id)

    def models(self) -> list[str]:
        """Models with at least one live serving worker, sorted."""
        return sorted({w.model for w in self.live_workers()})

    def model_state(self, model: str) -> ModelState:
        """See :class:`ModelState`."""
        if any(w.model == model for w in self.live_workers()):
            return ModelState.serving
        return ModelState.unavailable if model in self.models_seen else ModelState.unknown

    def tokenizer_spec(self, model: str) -> str | None:
        """The tokenizer spec advertised by ``model``'s live workers (the
        lowest worker id wins if they disagree), or None if none is live."""
        for w in self.live_workers():
            if w.model == model:
                return self.tokenizer_specs.get(w.worker_id, "bytes")
        return None

    def context_length(self, model: str) -> int | None:
        """The context length (tokens) a request for ``model`` must fit: the
        smallest one its live serving workers advertise (the router may pick
        any of them), or None if none advertises one."""
        lengths = [self.context_lengths[w.worker_id] for w in self.live_workers()
                   if w.model == model and w.worker_id in self.context_lengths]
        return min(lengths, default=None)

    def _forget(self, worker_id: str) -> None:
        self.tokenizer_specs.pop(worker_id, None)
        self.context_lengths.pop(worker_id, None)


def _apply_records(registry: WorkerRegistry, batches: dict) -> int:
    count = 0
    for records in batches.values():
        for msg in records:
            try:
                registry.apply(decode(WorkerHeartbeat, msg.value))
                count += 1
            except RecordError as exc:
                # Tombstones (None values) and foreign records: the router
                # dead-letters bad heartbeats; the bridge only skips them.
                if msg.value:
                    log.warning("skipping bad heartbeat at %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
    return count


async def assign_workers_topic(consumer: AIOKafkaConsumer, catalog: Catalog) -> None:
    """Assign every partition of the workers topic to the (started) consumer,
    positioned at the beginning. Partition counts come from the catalog
    (topics are created with them up front)."""
    tps = [TopicPartition(catalog.workers.name, p) for p in range(catalog.workers.partitions)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)


async def catch_up(consumer: AIOKafkaConsumer, registry: WorkerRegistry, max_wait_s: float = 3.0) -> int:
    """Read heartbeats until a fetch comes back empty or ``max_wait_s`` passes.

    An empty fetch stands in for "reached the end": the embedded broker's
    ListOffsets cannot be trusted for end offsets (see
    :mod:`kvflow.streams.tansu_compat`). Returns the number of heartbeats applied.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    total = 0
    while loop.time() < deadline:
        batches = await consumer.getmany(timeout_ms=200)
        if not any(batches.values()):
            break
        total += _apply_records(registry, batches)
    return total


async def follow_workers(consumer: AIOKafkaConsumer, registry: WorkerRegistry, retry_s: float = 1.0,
                         on_applied: Callable[[], None] | None = None) -> None:
    """Fold heartbeats into ``registry`` forever (cancel to stop); ``on_applied``
    is called after each batch of heartbeats is folded in.

    A failed fetch is logged and retried after ``retry_s``: if the broker
    stays away, workers expire from the projection and requests get 503
    rather than the bridge dying.
    """
    while True:
        try:
            batches = await consumer.getmany(timeout_ms=1000)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - keep following through broker hiccups
            log.warning("workers topic fetch failed; retrying in %.1f s", retry_s, exc_info=True)
            await asyncio.sleep(retry_s)
            continue
        if _apply_records(registry, batches) and on_applied is not None:
            on_applied()
