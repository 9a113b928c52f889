"""The metrics sink service: the metrics topic into ClickHouse, at least once.

One loop: fetch a batch → decode each record (malformed ones go to the
dead-letter topic) → :meth:`MetricsSink.add <kvflow.planner.sink.MetricsSink.add>`
→ every ``flush_interval_s`` insert the buffer on the ClickHouse thread →
commit the consumed offsets, only after the insert succeeded. A crash
therefore re-reads what was not yet inserted (rows may repeat,
``request_id`` identifies them); nothing is lost.

Partitions: the service *assigns* every metrics partition to itself and
commits under the group ``<namespace>.planner-sink`` without joining it.
One sink per deployment owns the ClickHouse directory anyway, so there is
nothing to balance, and assignment skips the group join (seconds on the
embedded broker). A restart resumes from the committed offsets; a first
start reads the topic from its beginning.

Flushes also run on demand (:meth:`SinkService.flush`): the planner flushes
right before it queries, so its window sees every record consumed so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

from aiokafka import TopicPartition

from kvflow.aio import cancel_and_wait
from kvflow.planner.sink import MetricsSink
from kvflow.schemas import MetricRecord
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import DeadLetterWriter, make_consumer, make_producer

__all__ = ["SinkService", "sink_group"]

log = logging.getLogger(__name__)


def sink_group(settings: Settings) -> str:
    """Consumer group the sink commits its offsets under: ``<namespace>.planner-sink``."""
    return f"{settings.namespace}.planner-sink"


class SinkService:
    """Consume the metrics topic into ClickHouse through a :class:`MetricsSink`.

    Args:
        settings: Kafka settings (``bootstrap_servers`` set).
        catalog: topic catalog.
        clickhouse: the process's :class:`~kvflow.planner.service.SharedClickHouse`.
        flush_interval_s: longest time a consumed record waits before insert, s.
        batch_rows: buffered rows that trigger an early flush.
        max_pending_rows: while this many rows are buffered (inserts failing),
            stop fetching and retry the flush instead (backpressure).
        fetch_max_wait_ms: fetch long-poll; metrics are not latency critical,
            so this is longer than the request path's.
    """

    def __init__(self, settings: Settings, catalog: Catalog, clickhouse, *, flush_interval_s: float = 1.0,
                 batch_rows: int = 50_000, max_pending_rows: int = 1_000_000, fetch_max_wait_ms: int = 100) -> None:
        if flush_interval_s <= 0 or batch_rows < 1 or max_pending_rows < batch_rows:
            raise ValueError("need flush_interval_s > 0, batch_rows >= 1 and max_pending_rows >= batch_rows")
        self.settings, self.catalog, self.clickhouse = settings, catalog, clickhouse
        self.flush_interval_s = flush_interval_s
        self.batch_rows = batch_rows
        self.max_pending_rows = max_pending_rows
        # The sink's own size trigger would insert on the event loop; this
        # service decides when to flush and always does it on the ClickHouse thread.
        self.sink = MetricsSink(clickhouse.client, batch_rows=sys.maxsize, flush_interval_s=flush_interval_s)
        self.producer = make_producer(settings)
        self.consumer = make_consumer(settings, group_id=sink_group(settings), enable_auto_commit=False,
                                      auto_offset_reset="earliest", fetch_max_wait_ms=fetch_max_wait_ms)
        self.dlq = DeadLetterWriter(self.producer, catalog, consumer="planner-sink")
        self.partitions = [TopicPartition(catalog.metrics.name, p) for p in range(catalog.metrics.partitions)]
        self.flush_failures = 0
        self._consumed: dict[TopicPartition, int] = {}  # next offset per partition, added to the buffer
        self._lock = asyncio.Lock()  # add and flush never overlap (flush swaps the buffer)
        self._last_flush_s = time.monotonic()
        self._task: asyncio.Task | None = None

    @property
    def rows_written(self) -> int:
        """Rows inserted since start."""
        return self.sink.rows_written

    @property
    def pending(self) -> int:
        """Rows buffered, not yet inserted."""
        return self.sink.pending

    async def start(self) -> None:
        """Connect, assign every metrics partition, and start consuming in the background."""
        await self.producer.start()
        await self.consumer.start()
        self.consumer.assign(self.partitions)
        self._task = asyncio.create_task(self.run(), name="planner-sink")
        log.info("metrics sink consuming %s (%d partitions) into %s", self.catalog.metrics.name,
                 len(self.partitions), self.clickhouse.location)

    async def stop(self) -> None:
        """Stop consuming, flush and commit what was consumed, close clients."""
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(Exception):
            await self.flush()
        await self.consumer.stop()
        await self.producer.stop()

    async def run(self) -> None:
        """Consume until cancelled; never dies of a bad record, a failed insert or a broker error."""
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep consuming through transient broker errors
                log.exception("metrics consumer error; retrying")
                await asyncio.sleep(1.0)

    async def _step(self) -> None:
        if self.pending >= self.max_pending_rows:
            await asyncio.sleep(min(self.flush_interval_s, 1.0))  # backpressure: inserts are failing
            await self._try_flush()
            return
        timeout_ms = max(1, int(min(self.flush_interval_s, 0.5) * 1000))
        batches = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=10_000)
        if batches:
            await self._add(batches)
        if self.pending >= self.batch_rows or time.monotonic() - self._last_flush_s >= self.flush_interval_s:
            await self._try_flush()

    async def _add(self, batches: dict) -> None:
        decoded = {tp: [await self.dlq.decode(MetricRecord, msg) for msg in records] for tp, records in batches.items()}
        async with self._lock:
            for tp, records in decoded.items():
                self.sink.add(r for r in records if r is not None)
                self._consumed[tp] = batches[tp][-1].offset + 1  # dead letters count as done

    async def _try_flush(self) -> None:
        try:
            await self.flush()
        except Exception:  # noqa: BLE001 - rows stay buffered and offsets uncommitted; retried next interval
            self.flush_failures += 1
            log.exception("metrics flush failed (%d rows kept for retry)", self.pending)

    async def flush(self) -> int:
        """Insert everything buffered, then commit the offsets it came from.

        Returns:
            Rows inserted.

        Raises:
            clickhouse_connect.driver.exceptions.DatabaseError: the insert
                failed; rows stay buffered and nothing is committed.
        """
        async with self._lock:
            self._last_flush_s = time.monotonic()
            offsets = dict(self._consumed)
            written = await self.clickhouse.run(self.sink.flush) if self.sink.pending else 0
            if offsets:
                try:
                    await self.consumer.commit(offsets)
                    self._consumed.clear()  # nothing was added meanwhile: we hold the lock
                except Exception:  # noqa: BLE001 - the next flush commits newer offsets
                    log.warning("metrics offset commit failed; retried after the next flush", exc_info=True)
            return written
