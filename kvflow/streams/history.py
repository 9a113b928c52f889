"""Read a topic's history: every record of every partition, from the beginning.

The log is the deployment's record of what happened, so past state can be
rebuilt from it (``kvflow index --at``). :func:`read_topic` stops once each
partition's position reaches the high watermark its latest fetch reported
(the embedded broker's ListOffsets can be short by a batch, so the fetch's
figure is the one trusted), or after ``idle_ms`` without a record.
"""

from __future__ import annotations

import asyncio

from aiokafka import ConsumerRecord, TopicPartition

from kvflow.progress import progress as make_progress
from kvflow.settings import Settings
from kvflow.streams.catalog import TopicSpec
from kvflow.streams.kafka import make_consumer

__all__ = ["read_topic"]


async def read_topic(settings: Settings, spec: TopicSpec, *, idle_ms: int = 1000,
                     timeout_s: float = 300.0, progress: bool = False) -> list[ConsumerRecord]:
    """Every record of topic ``spec`` present when reading began, per
    partition in offset order, partitions one after another. With
    ``progress``, records read are reported on stderr (:mod:`kvflow.progress`).

    Raises:
        aiokafka.errors.KafkaError: the broker cannot be reached.
        TimeoutError: the topic was not read whole within ``timeout_s``.
    """
    consumer = make_consumer(settings, auto_offset_reset="earliest", fetch_max_wait_ms=100)
    await consumer.start()
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        bar = make_progress(sum(max(0, ends[tp] - starts[tp]) for tp in tps), f"reading {spec.name}",
                            unit="records", enabled=progress)
        found: dict[TopicPartition, list[ConsumerRecord]] = {tp: [] for tp in tps}
        pending = {tp for tp in tps if ends[tp] > 0}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last_record = loop.time()
        while pending:
            if loop.time() > deadline:
                raise TimeoutError(f"{spec.name} not read whole in {timeout_s} s")
            batches = await consumer.getmany(*pending, timeout_ms=200, max_records=10000)
            if batches:
                last_record = loop.time()
            for tp, records in batches.items():
                found[tp].extend(records)
                bar.update(len(records))
            for tp in list(pending):
                highwater = consumer.highwater(tp)
                end = max(ends[tp], highwater or 0)
                if await consumer.position(tp) >= end:
                    pending.discard(tp)
            if not batches and (loop.time() - last_record) * 1000 >= idle_ms:
                break
        bar.close()
        return [msg for tp in tps for msg in found[tp]]
    finally:
        await consumer.stop()
