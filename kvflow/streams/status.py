"""``kvflow status``: live workers (the workers projection, :mod:`kvflow.streams.workers`) and queue depths."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvflow.schemas import now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import make_consumer
from kvflow.streams.workers import read_workers

__all__ = ["collect_status", "render_status"]


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
    views = list((await read_workers(settings, catalog)).views.values())
    rows = []
    depths = await asyncio.gather(*(
        _queue_depth(settings, TopicPartition(w.queue_topic, w.queue_partition),
                     f"{settings.namespace}.worker.{w.role.value}.{w.queue_partition}")
        for w in views))
    for w, depth in zip(views, depths):
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
