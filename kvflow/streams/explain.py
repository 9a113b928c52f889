"""``kvflow explain REQUEST_ID``: the router's decisions for one request, from the routing-decisions topic."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka import TopicPartition

from kvflow.schemas import CandidateCost, DecisionOutcome, DecisionRecord, RecordError, decode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import make_consumer

__all__ = ["read_decisions", "render_decision"]


async def read_decisions(settings: Settings, request_id: str, catalog: Catalog | None = None, *,
                         idle_ms: int = 1000, timeout_s: float = 60.0) -> list[DecisionRecord]:
    """Every routing decision recorded for ``request_id``, oldest first.

    Reads the whole routing-decisions topic: all partitions, from the
    beginning, until each partition's position reaches the high watermark
    its latest fetch reported (the end of the topic when reading began, as
    far as the broker has told), or ``idle_ms`` pass without a record, or
    ``timeout_s`` seconds in all. Records are matched by key (the request
    id) and then by content; malformed ones are skipped.

    Raises:
        ValueError: the settings name no bootstrap servers.
        aiokafka.errors.KafkaError: the broker cannot be reached.
    """
    catalog = catalog or Catalog(settings.namespace)
    spec = catalog.routing_decisions
    key = request_id.encode()
    consumer = make_consumer(settings, auto_offset_reset="earliest", fetch_max_wait_ms=100)
    await consumer.start()
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        found: list[DecisionRecord] = []
        pending = set(tps)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last_record = loop.time()
        while pending and loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            if batches:
                last_record = loop.time()
            for records in batches.values():
                for msg in records:
                    if msg.key != key:
                        continue
                    with contextlib.suppress(RecordError):
                        record = decode(DecisionRecord, msg.value)
                        if record.request_id == request_id:
                            found.append(record)
            for tp in list(pending):
                highwater = consumer.highwater(tp)
                if highwater is not None and await consumer.position(tp) >= highwater:
                    pending.discard(tp)
            if not batches and (loop.time() - last_record) * 1000 >= idle_ms:
                break
        return sorted(found, key=lambda r: r.decided_ms)
    finally:
        await consumer.stop()


_TERMS = (  # (column, CandidateCost field)
    ("overlap", "overlap_blocks"),
    ("host_overlap", "host_overlap_blocks"),
    ("disk_overlap", "disk_overlap_blocks"),
    ("prefill_blocks", "prefill_blocks"),
    ("queued_prefill", "queued_prefill_blocks"),
    ("decode_reqs", "decode_requests"),
    ("stall_exposure", "stall_exposure"),
    ("load", "load"),
    ("cost", "cost"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _table(candidates: list[CandidateCost], chosen: str | None) -> list[str]:
    """Rows of candidates sorted by cost (no cost last, then by worker id); the chosen one marked ``*``."""
    # overlap_blocks is never None: show it where the policy looked at the cache (or found any).
    kv_aware = any(c.prefill_blocks is not None or c.overlap_blocks for c in candidates)
    cols = [(name, attr) for name, attr in _TERMS
            if (kv_aware if attr == "overlap_blocks" else any(getattr(c, attr) is not None for c in candidates))]
    rows = sorted(candidates, key=lambda c: (c.cost is None, c.cost or 0.0, c.worker_id))
    header = [" ", "worker_id", *(name for name, _ in cols)]
    body = [["*" if c.worker_id == chosen else " ", c.worker_id, *(_cell(getattr(c, attr)) for _, attr in cols)]
            for c in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
            for r in [header, *body]]


def render_decision(record: DecisionRecord) -> str:
    """A plain-text account of one decision: outcome and chosen worker, policy,
    router, time and ISL, then a table of the candidates (overlap, load terms
    and cost, sorted by cost; the chosen worker marked ``*``), and the same
    for the prefill candidates of a remote prefill."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.decided_ms / 1000))
    when += f".{record.decided_ms % 1000:03d}"
    if record.outcome is DecisionOutcome.routed:
        head = f"request {record.request_id}: routed to {record.worker_id}"
    else:
        head = f"request {record.request_id}: {record.outcome.value}"
    lines = [head,
             f"  model {record.model}, {record.role.value} pool, policy {record.policy}, "
             f"router {record.router_id or '?'}, decided {when}, ISL {record.isl} tokens"]
    if record.prefill_worker_id:
        lines.append(f"  prefill: remote on {record.prefill_worker_id}")
    elif record.prefill_reason:
        lines.append(f"  prefill: local ({record.prefill_reason.replace('_', ' ')})")
    if record.reason:
        lines.append(f"  reason: {record.reason}")
    if record.candidates:
        lines.append(f"  candidates ({len(record.candidates)}):")
        lines += [f"    {row}" for row in _table(record.candidates, record.worker_id)]
    if record.prefill_candidates:
        lines.append(f"  prefill candidates ({len(record.prefill_candidates)}):")
        lines += [f"    {row}" for row in _table(record.prefill_candidates, record.prefill_worker_id)]
    return "\n".join(lines)
