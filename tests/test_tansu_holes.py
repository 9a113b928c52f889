"""A consumer tailing a partition that several producers write gets every
record, in offset order, although the embedded broker can make a batch
readable before a lower-offset one (kvflow.streams.tansu_compat)."""

from __future__ import annotations

import asyncio
import random

from aiokafka import TopicPartition

from kvflow.streams import tansu_compat
from kvflow.streams.kafka import make_consumer, make_producer

PRODUCERS = 6
RECORDS = 2000


async def test_a_live_consumer_skips_no_record_written_by_concurrent_producers(kafka):
    settings, catalog = kafka
    tp = TopicPartition(catalog.responses.name, 1)
    consumer = make_consumer(settings)
    await consumer.start()
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    start = await consumer.position(tp)
    read: list[tuple[int, bytes]] = []
    writing, written = asyncio.Event(), asyncio.Event()

    async def tail() -> None:  # to the end of what was written (a skipped record is not waited for)
        while not (written.is_set() and await consumer.position(tp) >= start + PRODUCERS * RECORDS):
            batches = await consumer.getmany(tp, timeout_ms=1000)
            read.extend((m.offset, m.value) for m in batches.get(tp, []))

    async def write(i: int) -> None:
        rng = random.Random(i)
        producer = make_producer(settings)
        await producer.start()
        try:
            await writing.wait()
            for j in range(RECORDS):
                await producer.send(tp.topic, f"{i}:{j}".encode(), partition=tp.partition)
                await asyncio.sleep(rng.random() * 0.004)
            await producer.flush()
        finally:
            await producer.stop()

    reader = asyncio.create_task(tail())
    try:
        writers = [asyncio.create_task(write(i)) for i in range(PRODUCERS)]
        writing.set()
        await asyncio.gather(*writers)
        written.set()
        await asyncio.wait_for(reader, 120)
    finally:
        reader.cancel()
        await consumer.stop()
    offsets = [o for o, _ in read]
    assert offsets == list(range(start, start + PRODUCERS * RECORDS)), f"{tansu_compat.refetches} refetches"
    assert {v for _, v in read} == {f"{i}:{j}".encode() for i in range(PRODUCERS) for j in range(RECORDS)}
    for i in range(PRODUCERS):  # each producer's records in the order sent
        mine = [int(v.split(b":")[1]) for _, v in read if v.startswith(f"{i}:".encode())]
        assert mine == sorted(mine)


def test_a_hole_is_refetched_until_it_has_been_open_too_long():
    tp, t0 = ("t", 0), 1000.0
    assert tansu_compat._hole_open(tp, 7, t0)
    assert tansu_compat._hole_open(tp, 7, t0 + tansu_compat.GAP_ACCEPT_S / 2)
    assert not tansu_compat._hole_open(tp, 7, t0 + tansu_compat.GAP_ACCEPT_S)  # accepted: moved past
    assert tansu_compat._hole_open(tp, 7, t0 + 2 * tansu_compat.GAP_ACCEPT_S)  # a new hole there starts afresh
    tansu_compat._holes.clear()
