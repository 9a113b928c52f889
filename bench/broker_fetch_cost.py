"""What a fetch costs the embedded broker (by wait and by stored batches) and how late its long poll delivers.

Starts an embedded Tansu broker (memory storage) and measures its CPU time
(``/proc`` via psutil, user + system) per Kafka request:

1. ``empty_fetch_ms``: a fetch of an idle partition at each ``--waits``
   fetch max-wait (ms), and the broker's share of one core while a
   consumer long-polls back to back at that wait;
2. ``tail_fetch_ms``: produce one record, then fetch it from the tail (the
   pattern of a reader following a topic), when the partition holds 0, then
   ``--grow`` records; ``other_partition`` grows a *different* partition of
   the same topic first, to tell a per-partition cost from a broker-wide one;
   ``single_batches_N`` grows a third partition by ``--grow-single`` records
   sent one produce request (so one batch) each, to tell a cost per stored
   batch from a cost per record (the broker's memory store keeps each
   produced batch as one object and lists a partition's objects on every
   fetch that returns data); ``recreated_topic`` measures that partition
   again after the topic was deleted and created anew (the broker refuses
   DeleteRecords, but a deleted topic's batches go with it);
3. ``long_poll_latency_ms``: for each ``--waits`` fetch max-wait, a consumer
   tails an idle partition while single records are produced at random
   gaps (uniform in 0..wait, so they land anywhere in a parked fetch); the
   p50 and largest time from produce to the record in the consumer's hands
   (the broker re-checks a parked fetch on a halving timer, so a record
   waits for the next check).
4. ``produce_fetch_ms_by_size``: broker CPU ms to take one record of each
   ``--sizes`` bytes and hand it to a consumer tailing the partition (a
   fresh partition per size), e.g. a request record with a long prompt's
   token ids.

psutil's CPU times tick in 10 ms steps, so figures are means over
``--samples`` requests.

    python bench/broker_fetch_cost.py [--grow 100000] [--samples 200]

Last stdout line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvflow.streams.broker import EmbeddedBroker

VALUE = json.dumps({"type": "delta", "request_id": "r" * 32, "token_ids": list(range(8)),
                    "text": "hello world " * 4}).encode()  # the size of a typical coalesced token delta


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc``."""
    t = proc.cpu_times()
    return t.user + t.system


async def empty_fetch(broker: psutil.Process, bootstrap: str, wait_ms: int, samples: int) -> tuple[float, float]:
    """(broker CPU ms per empty fetch, broker % of one core) for back-to-back fetches of an idle partition."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=wait_ms)
    await c.start()
    try:
        tp = TopicPartition("idle", 0)
        c.assign([tp])
        await c.seek_to_end(tp)
        await c.getmany(tp, timeout_ms=2 * wait_ms)
        c0, t0 = cpu_s(broker), time.monotonic()
        for _ in range(samples):
            await c.getmany(tp, timeout_ms=2 * wait_ms)
        used, wall = cpu_s(broker) - c0, time.monotonic() - t0
        return round(1000 * used / samples, 3), round(100 * used / wall, 2)
    finally:
        await c.stop()


async def tail_fetch(broker: psutil.Process, prod: AIOKafkaProducer, cons: AIOKafkaConsumer,
                     tp: TopicPartition, samples: int) -> float:
    """Broker CPU ms per fetch that returns the one record just produced to ``tp``."""
    end = (await cons.end_offsets([tp]))[tp]
    cons.seek(tp, end)
    used = 0.0
    for _ in range(samples):
        await prod.send_and_wait(tp.topic, VALUE, partition=tp.partition)
        c0 = cpu_s(broker)
        await cons.getmany(tp, timeout_ms=1000)
        used += cpu_s(broker) - c0
    return round(1000 * used / samples, 3)


async def long_poll_latency(bootstrap: str, prod: AIOKafkaProducer, tp: TopicPartition, wait_ms: int,
                            samples: int) -> dict:
    """p50 and max ms from produce to delivery for a consumer long-polling ``tp`` with ``wait_ms``."""
    cons = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=wait_ms)
    await cons.start()
    try:
        cons.assign([tp])
        await cons.seek_to_end(tp)
        await cons.getmany(tp, timeout_ms=2 * wait_ms)
        rng = random.Random(0)
        latencies = []
        for _ in range(samples):
            await asyncio.sleep(rng.uniform(0.0, wait_ms / 1000))  # lands anywhere in the parked fetch
            sent = time.monotonic()
            await prod.send_and_wait(tp.topic, VALUE, partition=tp.partition)
            while not (await cons.getmany(tp, timeout_ms=5 * wait_ms + 1000)):
                pass
            latencies.append(1000 * (time.monotonic() - sent))
        latencies.sort()
        return {"p50": round(latencies[len(latencies) // 2], 1), "max": round(latencies[-1], 1)}
    finally:
        await cons.stop()


async def grow(prod: AIOKafkaProducer, tp: TopicPartition, n: int) -> None:
    """Append ``n`` records to ``tp`` in batches of 500."""
    for _ in range(n // 500):
        futures = [await prod.send(tp.topic, VALUE, partition=tp.partition) for _ in range(500)]
        await asyncio.gather(*futures)


async def grow_single(prod: AIOKafkaProducer, tp: TopicPartition, n: int) -> None:
    """Append ``n`` records to ``tp``, each in its own produce request (one batch per record)."""
    for _ in range(n):
        await prod.send_and_wait(tp.topic, VALUE, partition=tp.partition)


async def produce_fetch_by_size(broker: psutil.Process, bootstrap: str, prod: AIOKafkaProducer, sizes: list[int],
                                samples: int) -> dict:
    """Broker CPU ms per record of each size, produced and fetched back from the tail."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(f"size-{size}", 1, 1) for size in sizes])
    finally:
        await admin.close()
    out = {}
    for size in sizes:
        cons = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=40,
                                max_partition_fetch_bytes=4 * max(sizes))
        await cons.start()
        try:
            tp = TopicPartition(f"size-{size}", 0)
            cons.assign([tp])
            await cons.seek_to_end(tp)
            value = b"x" * size
            c0 = cpu_s(broker)
            for _ in range(samples):
                await prod.send_and_wait(tp.topic, value, partition=0)
                while not (await cons.getmany(tp, timeout_ms=1000)).get(tp):
                    pass
            out[size] = round(1000 * (cpu_s(broker) - c0) / samples, 3)
        finally:
            await cons.stop()
    return out


async def recreate_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """Delete ``topic`` and create it again, empty, with ``partitions`` partitions."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


async def run(args: argparse.Namespace) -> dict:
    """Run the three measurements; returns the figures."""
    async with EmbeddedBroker() as b:
        admin = AIOKafkaAdminClient(bootstrap_servers=b.bootstrap_servers)
        await admin.start()
        await admin.create_topics([NewTopic("tail", 3, 1), NewTopic("idle", 1, 1), NewTopic("poll", 1, 1)])
        await admin.close()
        broker = psutil.Process(b.process.pid)
        out: dict = {"empty_fetch_ms": {}, "broker_pct_of_core_long_polling": {}, "tail_fetch_ms": {},
                     "long_poll_latency_ms": {}}
        for wait in args.waits:
            ms, pct = await empty_fetch(broker, b.bootstrap_servers, wait, max(10, args.samples // 10))
            out["empty_fetch_ms"][wait], out["broker_pct_of_core_long_polling"][wait] = ms, pct
        prod = AIOKafkaProducer(bootstrap_servers=b.bootstrap_servers, linger_ms=0,
                                max_request_size=max(1 << 20, 2 * max(args.sizes, default=0)))
        cons = AIOKafkaConsumer(bootstrap_servers=b.bootstrap_servers, enable_auto_commit=False,
                                fetch_max_wait_ms=500)
        await prod.start()
        await cons.start()
        try:
            for wait in args.waits:
                out["long_poll_latency_ms"][wait] = await long_poll_latency(
                    b.bootstrap_servers, prod, TopicPartition("poll", 0), wait, max(20, args.samples // 4))
            mine, other = TopicPartition("tail", 0), TopicPartition("tail", 1)
            cons.assign([mine])
            out["tail_fetch_ms"]["empty_log"] = await tail_fetch(broker, prod, cons, mine, args.samples)
            await grow(prod, other, args.grow)
            out["tail_fetch_ms"]["other_partition"] = await tail_fetch(broker, prod, cons, mine, args.samples)
            await grow(prod, mine, args.grow)
            out["tail_fetch_ms"][f"log_{args.grow}"] = await tail_fetch(broker, prod, cons, mine, args.samples)
            if args.grow_single:
                single = TopicPartition("tail", 2)
                await grow_single(prod, single, args.grow_single)
                cons.assign([single])
                out["tail_fetch_ms"][f"single_batches_{args.grow_single}"] = await tail_fetch(
                    broker, prod, cons, single, args.samples)
                await recreate_topic(b.bootstrap_servers, "tail", 3)
                cons.assign([single])
                out["tail_fetch_ms"]["recreated_topic"] = await tail_fetch(broker, prod, cons, single, args.samples)
            if args.sizes:
                out["produce_fetch_ms_by_size"] = await produce_fetch_by_size(
                    broker, b.bootstrap_servers, prod, args.sizes, max(20, args.samples // 2))
        finally:
            await prod.stop()
            await cons.stop()
        return out


def main() -> None:
    """Parse arguments, run, print the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grow", type=int, default=100_000, help="records appended before the second tail measurement")
    ap.add_argument("--grow-single", type=int, default=10_000,
                    help="records appended one batch each before the third tail measurement (0: skip)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--waits", type=int, nargs="+", default=[10, 40, 200, 1000], help="fetch max-waits (ms)")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1_000, 110_000, 220_000],
                    help="record sizes (bytes) for produce_fetch_ms_by_size (none: skip)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
