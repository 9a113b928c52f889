"""Buffer metric records and insert them into ClickHouse in columnar batches.

The Kafka consumer that feeds this sink is a thin adapter::

    sink.add(decode(MetricRecord, msg.value) for msg in batch)
    sink.flush_if_due()            # or on a timer
    consumer.commit()              # only after a flush succeeded

Rows go to ClickHouse as Arrow tables (``client.insert_arrow``), never as
JSON text: one column array per field, so a million rows cost one insert.
Delivery is at-least-once: a failed insert keeps the rows buffered and raises;
retrying after a partial failure can duplicate rows (``request_id`` identifies
them). The client is synchronous; call :meth:`MetricsSink.flush` through
``asyncio.to_thread`` from async code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from operator import attrgetter

import pyarrow as pa
from clickhouse_connect.driver.client import Client

from kvflow.schemas.metrics import RequestMetrics, WorkerMetrics

__all__ = ["MetricsSink", "REQUEST_TABLE", "WORKER_TABLE", "request_table", "worker_table"]

REQUEST_TABLE = "request_metrics"
"""ClickHouse table for :class:`RequestMetrics` (see ``infra/clickhouse/001_metrics.sql``)."""
WORKER_TABLE = "worker_metrics"
"""ClickHouse table for :class:`WorkerMetrics`."""

_TS = pa.timestamp("ms", tz="UTC")

# (column, record attribute, arrow type); the order and names match the DDL.
_REQUEST_COLUMNS: tuple[tuple[str, str, pa.DataType], ...] = (
    ("ts", "ts_ms", pa.int64()),
    ("worker_id", "worker_id", pa.string()),
    ("model", "model", pa.string()),
    ("request_id", "request_id", pa.string()),
    ("isl", "isl", pa.int32()),
    ("osl", "osl", pa.int32()),
    ("ttft_ms", "ttft_ms", pa.float64()),
    ("itl_ms", "itl_ms", pa.float64()),
    ("e2e_ms", "e2e_ms", pa.float64()),
    ("cached_tokens", "cached_tokens", pa.int32()),
    ("ok", "ok", pa.bool_()),
    ("source", "source", pa.string()),
)
_WORKER_COLUMNS: tuple[tuple[str, str, pa.DataType], ...] = (
    ("ts", "ts_ms", pa.int64()),
    ("worker_id", "worker_id", pa.string()),
    ("role", "role", pa.string()),
    ("active_requests", "active_requests", pa.int32()),
    ("waiting_requests", "waiting_requests", pa.int32()),
    ("kv_used_blocks", "kv_used_blocks", pa.int32()),
    ("kv_total_blocks", "kv_total_blocks", pa.int32()),
    ("queue_depth", "queue_depth", pa.int32()),
    ("prefill_tokens_per_s", "prefill_tokens_per_s", pa.float64()),
    ("decode_tokens_per_s", "decode_tokens_per_s", pa.float64()),
    ("aborted_requests", "aborted_requests", pa.int32()),
)


def _to_arrow(records: list, columns: tuple[tuple[str, str, pa.DataType], ...]) -> pa.Table:
    arrays = {}
    for name, attr, dtype in columns:
        get = attrgetter(attr)
        arr = pa.array([get(r) for r in records], type=dtype)
        arrays[name] = arr.cast(_TS) if name == "ts" else arr
    return pa.table(arrays)


def request_table(records: list[RequestMetrics]) -> pa.Table:
    """Columnar form of request records: one row each, columns as in ``request_metrics``."""
    return _to_arrow(records, _REQUEST_COLUMNS)


def worker_table(records: list[WorkerMetrics]) -> pa.Table:
    """Columnar form of worker snapshots: one row each, columns as in ``worker_metrics``."""
    return _to_arrow(records, _WORKER_COLUMNS)


class MetricsSink:
    """Buffers :class:`RequestMetrics` / :class:`WorkerMetrics` and inserts them in batches.

    A flush happens when ``batch_rows`` rows are buffered (checked in
    :meth:`add`), when :meth:`flush_if_due` finds the oldest buffered row older
    than ``flush_interval_s``, or on an explicit :meth:`flush`. Each flush is
    at most one insert per table, whatever the row count.

    Args:
        client: an open client whose database holds the kvflow tables
            (:func:`kvflow.planner.clickhouse.ensure_schema`).
        batch_rows: buffered rows (both tables together) that trigger a flush.
        flush_interval_s: longest time a row waits in the buffer, seconds.
        clock: monotonic seconds; injected so tests control time.
    """

    def __init__(self, client: Client, *, batch_rows: int = 50_000, flush_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if batch_rows < 1 or flush_interval_s < 0:
            raise ValueError("batch_rows must be >= 1 and flush_interval_s >= 0")
        self._client = client
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._requests: list[RequestMetrics] = []
        self._workers: list[WorkerMetrics] = []
        self._oldest_s: float | None = None
        self.rows_written = 0
        """Rows inserted since construction (both tables)."""

    @property
    def pending(self) -> int:
        """Rows buffered and not yet inserted."""
        return len(self._requests) + len(self._workers)

    def add(self, records: Iterable[RequestMetrics | WorkerMetrics]) -> int:
        """Buffer records; flush if ``batch_rows`` is reached.

        Returns:
            Rows inserted by this call (0 when nothing was flushed).

        Raises:
            TypeError: a record is neither ``RequestMetrics`` nor ``WorkerMetrics``.
        """
        for rec in records:
            if isinstance(rec, RequestMetrics):
                self._requests.append(rec)
            elif isinstance(rec, WorkerMetrics):
                self._workers.append(rec)
            else:
                raise TypeError(f"MetricsSink takes RequestMetrics or WorkerMetrics, not {type(rec).__name__}")
        if self._oldest_s is None and self.pending:
            self._oldest_s = self._clock()
        return self.flush() if self.pending >= self.batch_rows else 0

    def flush_if_due(self) -> int:
        """Flush if the oldest buffered row has waited ``flush_interval_s``.

        Returns:
            Rows inserted (0 when not due or nothing buffered).
        """
        if self._oldest_s is not None and self._clock() - self._oldest_s >= self.flush_interval_s:
            return self.flush()
        return 0

    def flush(self) -> int:
        """Insert everything buffered: one Arrow insert per non-empty table.

        Returns:
            Rows inserted.

        Raises:
            clickhouse_connect.driver.exceptions.DatabaseError: the insert
                failed; rows not yet inserted stay buffered for a retry.
        """
        written = 0
        if self._requests:
            self._client.insert_arrow(REQUEST_TABLE, request_table(self._requests))
            written += len(self._requests)
            self._requests = []
        if self._workers:
            self._client.insert_arrow(WORKER_TABLE, worker_table(self._workers))
            written += len(self._workers)
            self._workers = []
        self._oldest_s = None
        self.rows_written += written
        return written

    def write(self, records: Iterable[RequestMetrics | WorkerMetrics]) -> int:
        """Buffer ``records`` and flush everything now. Returns rows inserted."""
        return self.add(records) + self.flush()
