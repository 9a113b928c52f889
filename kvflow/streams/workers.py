"""The workers projection: live workers, folded from the workers topic.

One fold of heartbeats (:class:`~kvflow.schemas.WorkerHeartbeat`) serves
every reader of the topic, so they agree on which workers are live:

* the router's routing table (:class:`kvflow.router.table.RoutingTable`
  holds a :class:`Workers` and adds in-flight load to its views);
* the HTTP bridge (:class:`kvflow.streams.bridge.worker_registry.WorkerRegistry`:
  ``/v1/models``, 404/503, the tokenizer and context length to use);
* ``kvflow status`` and the planner's replica count (:func:`read_workers`).

Rules (:meth:`Workers.apply`, :meth:`Workers.expire`): a heartbeat older
(``ts_ms``) than the one held is ignored, so replays and reordering cannot
resurrect a stale view; a ``stopped`` heartbeat removes the worker; a worker
silent for longer than its ``ttl_ms`` expires. Time is passed in, never
read here, so the fold is the same live and in the offline simulator.

The Kafka side: :func:`assign_workers_topic` positions a consumer on every
partition from the beginning (a fresh reader sees every worker),
:func:`catch_up` reads the history present at start, :func:`follow_workers`
keeps folding new heartbeats, :func:`read_workers` does a one-shot read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvflow.schemas import RecordError, WorkerHeartbeat, WorkerRole, WorkerStatus, decode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import FOLLOW_POLL_MS, make_consumer, start_consumer

__all__ = ["WorkerView", "Workers", "assign_workers_topic", "catch_up", "follow_workers", "read_workers",
           "liveness_idle_wait_ms", "liveness_wait"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerView:
    """What is known of one worker (from its last heartbeat).

    ``active_requests``, ``waiting_requests`` and ``active_prefill_tokens``
    (tokens) are the heartbeat's figures. The router reconciles them with
    the requests the worker ended since (:mod:`kvflow.router.inflight`),
    and fills the three fields a heartbeat alone leaves at their defaults:

    ``routed_since_heartbeat`` counts requests on the worker that the
    heartbeat's figures leave out: for a worker publishing inflight
    records, exactly the requests it took after the heartbeat plus those
    the router sent and it has not taken yet, less those that ended;
    otherwise, the requests the router sent after the heartbeat.
    ``routed_prefill_tokens`` is the prompt tokens those requests are
    expected to compute (tracked workers), or None (unknown: the router's
    cost assumes each is as large as the request being routed).
    ``stall_exposure`` (ms of mean inter-token latency per ms of prefill,
    summed over the requests the worker holds) is how much a new prefill
    placed there would stretch the per-request ITL of those requests in
    all (:func:`kvflow.router.inflight.stall_exposure`); 0 for workers
    publishing no inflight records.

    ``tokenizer`` is the tokenizer spec producers tokenize prompts with;
    ``context_length`` the longest sequence (tokens) the worker serves, or
    None when it advertises none; ``pool`` the worker pool it belongs to;
    ``lora_adapters`` the LoRA adapters loaded on it (names);
    ``media_tokens`` the placeholder tokens per media item an encode worker
    advertises (None on other roles).
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
    stall_exposure: float = 0.0
    tokenizer: str = "bytes"
    context_length: int | None = None
    pool: str = ""
    lora_adapters: tuple[str, ...] = ()
    media_tokens: int | None = None

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
            tokenizer=hb.tokenizer, context_length=hb.context_length, pool=hb.pool,
            lora_adapters=tuple(hb.lora_adapters), media_tokens=hb.media_tokens,
        )


@dataclass
class Workers:
    """Live workers by id (the rules of the module docstring).

    Attributes:
        views: each live worker's :class:`WorkerView` (serving or draining).
    """

    views: dict[str, WorkerView] = field(default_factory=dict)

    def apply(self, hb: WorkerHeartbeat) -> bool:
        """Fold one heartbeat in: replace the worker's view, or remove the
        worker if it ``stopped``. Returns False when the heartbeat is older
        than the one held (ignored), True otherwise."""
        held = self.views.get(hb.worker_id)
        if held is not None and hb.ts_ms < held.last_seen_ms:
            return False
        if hb.status == WorkerStatus.stopped:
            self.views.pop(hb.worker_id, None)
        else:
            self.views[hb.worker_id] = WorkerView.from_heartbeat(hb)
        return True

    def expire(self, now_ms: int) -> list[str]:
        """Drop workers whose last heartbeat is older than their TTL at ``now_ms``
        (epoch ms, or simulated); returns their ids."""
        views = self.views
        gone = [w.worker_id for w in views.values() if now_ms - w.last_seen_ms > w.ttl_ms]
        for worker_id in gone:
            del views[worker_id]
        return gone

    def next_expiry_ms(self) -> int | None:
        """When the first live worker expires unless it beats again (epoch ms,
        ``last_seen_ms + ttl_ms``), or None with no live worker."""
        return min((w.last_seen_ms + w.ttl_ms for w in self.views.values()), default=None)

    def serving(self, model: str | None = None) -> list[WorkerView]:
        """Serving workers (of ``model`` when given), sorted by worker id."""
        return sorted((w for w in self.views.values()
                       if w.status == WorkerStatus.serving and (model is None or w.model == model)),
                      key=lambda w: w.worker_id)

    def lora_base(self, name: str) -> str | None:
        """The base model of the lowest-id serving generation worker that lists LoRA adapter
        ``name``, or None when none does."""
        for w in self.serving():
            if name in w.lora_adapters and w.role.generates:
                return w.model
        return None

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-friendly list of workers, sorted by id (for status pages)."""
        return [
            {**{k: getattr(w, k) for k in w.__dataclass_fields__}, "role": w.role.value, "status": w.status.value}
            for w in sorted(self.views.values(), key=lambda w: w.worker_id)
        ]


Apply = Callable[[WorkerHeartbeat], Any]
"""What a reader does with each valid heartbeat (e.g. :meth:`Workers.apply`)."""


def _apply_records(apply: Apply, batches: dict) -> int:
    count = 0
    for records in batches.values():
        for msg in records:
            try:
                hb = decode(WorkerHeartbeat, msg.value)
            except RecordError as exc:
                # Tombstones (None values) and foreign records: the router
                # dead-letters bad heartbeats; other readers only skip them.
                if msg.value:
                    log.warning("skipping bad heartbeat at %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
                continue
            apply(hb)
            count += 1
    return count


async def assign_workers_topic(consumer: AIOKafkaConsumer, catalog: Catalog) -> None:
    """Assign every partition of the workers topic to the (started) consumer,
    positioned at the beginning. Partition counts come from the catalog
    (topics are created with them up front)."""
    tps = [TopicPartition(catalog.workers.name, p) for p in range(catalog.workers.partitions)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)


async def catch_up(consumer: AIOKafkaConsumer, apply: Apply, max_wait_s: float = 3.0, idle_ms: int = 200) -> int:
    """Fold heartbeats until a fetch of ``idle_ms`` comes back empty or ``max_wait_s`` passes.

    An empty fetch stands in for "reached the end": the embedded broker's
    ListOffsets cannot be trusted for end offsets (see
    :mod:`kvflow.streams.tansu_compat`). Returns the number of heartbeats applied.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    total = 0
    while loop.time() < deadline:
        batches = await consumer.getmany(timeout_ms=idle_ms)
        if not any(batches.values()):
            break
        total += _apply_records(apply, batches)
    return total


async def follow_workers(consumer: AIOKafkaConsumer, apply: Apply, retry_s: float = 1.0) -> None:
    """Fold heartbeats forever (cancel to stop).

    A failed fetch is logged and retried after ``retry_s``: if the broker
    stays away, workers expire from the projection (and the bridge answers
    503) rather than the reader dying.
    """
    while True:
        try:
            batches = await consumer.getmany(timeout_ms=FOLLOW_POLL_MS)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - keep following through broker hiccups
            log.warning("workers topic fetch failed; retrying in %.1f s", retry_s, exc_info=True)
            await asyncio.sleep(retry_s)
            continue
        _apply_records(apply, batches)


async def read_workers(settings: Settings, catalog: Catalog, idle_ms: int = 300, max_wait_s: float = 30.0
                       ) -> Workers:
    """Read the workers topic from the beginning into a fresh :class:`Workers`.

    Reading stops after ``idle_ms`` without new records (or after
    ``max_wait_s``); workers expired by then (wall clock) are dropped.

    Raises:
        aiokafka.errors.KafkaError: the broker cannot be reached.
    """
    consumer = make_consumer(settings)
    await start_consumer(consumer)
    try:
        await assign_workers_topic(consumer, catalog)
        workers = Workers()
        await catch_up(consumer, workers.apply, max_wait_s=max_wait_s, idle_ms=idle_ms)
        workers.expire(now_ms())
        return workers
    finally:
        await consumer.stop()


def liveness_idle_wait_ms(settings: Settings) -> int:
    """How late (ms) a reader that judges worker liveness from heartbeats
    (router, bridge) may see a heartbeat when an expiry is near: half the
    silence a busy worker's TTL tolerates after a missed beat,
    ``(worker_ttl_ms - heartbeat_interval_ms) / 2`` (2,000 at the defaults),
    and never above ``fetch_idle_wait_ms``. Periodic heartbeats ring no
    doorbell, so the reader's fetch wait sets how late it sees one; a longer
    wait near an expiry would expire live workers (:func:`liveness_wait`)."""
    return max(1, min(settings.fetch_idle_wait_ms, (settings.worker_ttl_ms - settings.heartbeat_interval_ms) // 2))


def liveness_wait(settings: Settings, workers: Workers, clock: Callable[[], int] = now_ms) -> Callable[[], int]:
    """The quiet-wait cap (ms, called before each fetch) of a consumer whose
    reader judges liveness from ``workers``: ``next_expiry - now - bound``,
    clamped to ``[bound, fetch_idle_wait_ms]``, where ``bound`` is
    :func:`liveness_idle_wait_ms` and ``clock`` returns epoch ms.

    A heartbeat written at ``t`` is then seen by ``t + bound`` at the
    latest, as with a fixed ``bound`` wait: a fetch sent with a longer wait
    returns ``bound`` before any worker can expire. But an idle deployment,
    whose workers beat every ``heartbeat_idle_ms`` with a TTL stretched to
    match, is fetched about once per idle period instead of once per
    ``bound`` (the broker's requests are most of kvflow's idle CPU)."""
    bound = liveness_idle_wait_ms(settings)
    longest = settings.fetch_idle_wait_ms  # never below bound

    def cap() -> int:
        expiry = workers.next_expiry_ms()
        if expiry is None:
            return longest
        return int(min(longest, max(bound, expiry - clock() - bound)))

    return cap

