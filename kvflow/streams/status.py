"""``kvflow status``: live workers (from the workers topic) and queue depths."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvflow.router.table import RoutingTable, apply_heartbeat, expire_workers
from kvflow.schemas import RecordError, WorkerHeartbeat, decode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import make_consumer

__all__ = ["read_routing_table", "collect_status", "render_status"]


async def read_routing_table(settings: Settings, catalog: Catalog, idle_ms: int = 300) -> RoutingTable:
    """Replay the workers topic from the beginning into a fresh routing table.

    Reading stops after ``idle_ms`` without new records; expired workers are dropped.
    """
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        tps = [TopicPartition(catalog.workers.name, p) for p in range(catalog.workers.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        table = RoutingTable()
        while True:
            batches = await consumer.getmany(timeout_ms=idle_ms)
            if not batches:
                break
            for records in batches.values():
                for msg in records:
                    try:
                        apply_heartbeat(table, decode(WorkerHeartbeat, msg.value))
                    except RecordError:
                        continue
        expire_workers(table, now_ms())
        return table
    finally:
        await consumer.stop()


async def _queue_depth(settings: Settings, tp: TopicPartition, group: str) -> int:
    """Records in ``tp`` past ``group``'s committed offset.

    The end offset comes from ListOffsets, which the embedded broker reports
    short by up to one batch (see :mod:`kvflow.streams.tansu_compat`): the
    depth shown there is a lower bound.
    """
    consumer: AIOKafkaConsumer = make_consumer(settings, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        end = (await consumer.end_offsets([tp]))[tp]
        committed = await consumer.committed(tp)
        return max(0, end - (committed or 0))
    finally:
        await consumer.stop()


async def collect_status(settings: Settings) -> list[dict[str, Any]]:
    """One dict per live worker: id, role, model, status, load, KV use and queue depth."""
    catalog = Catalog(settings.namespace)
    table = await read_routing_table(settings, catalog)
    rows = []
    depths = await asyncio.gather(*(
        _queue_depth(settings, TopicPartition(w.queue_topic, w.queue_partition),
                     f"{settings.namespace}.worker.{w.role.value}.{w.queue_partition}")
        for w in table.workers.values()))
    for w, depth in zip(table.workers.values(), depths):
        rows.append({
            "worker_id": w.worker_id, "role": w.role.value, "model": w.model, "status": w.status.value,
            "active": w.active_requests, "waiting": w.waiting_requests,
            "kv_used_blocks": w.kv_used_blocks, "kv_total_blocks": w.kv_total_blocks,
            "queue": f"{w.queue_topic}[{w.queue_partition}]", "queue_depth": depth,
            "age_ms": now_ms() - w.last_seen_ms,
        })
    return sorted(rows, key=lambda r: (r["role"], r["worker_id"]))


def render_status(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`collect_status` rows."""
    if not rows:
        return "no live workers"
    cols = ["worker_id", "role", "model", "status", "active", "waiting", "kv_used_blocks", "kv_total_blocks",
            "queue", "queue_depth"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)
