"""Pipeline overhead: bridge → requests → router → worker queue → worker → responses → bridge.

Runs `kvflow up`'s supervisor on the embedded broker with mocker workers at
(effectively) zero compute, sends non-streaming chat requests at a fixed rate
through the HTTP bridge, and reports end-to-end latency percentiles. In the
same run, on the same broker, it measures a bare produce → consume round trip
and prints the ratio of the two p50s.

    python bench/pipeline_overhead.py [--rate 20] [--requests 400] [--workers 2]

Last stdout line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from aiokafka import TopicPartition

from kvflow.schemas import WorkerRole
from kvflow.settings import Settings
from kvflow.streams.broker import free_port
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.supervisor import Supervisor, WorkerSpec


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def bare_round_trip(settings: Settings, topic: str, partition: int, n: int) -> list[float]:
    """Latency (ms) of producing one record and consuming it back, ``n`` times."""
    producer, consumer = make_producer(settings), make_consumer(settings)
    await producer.start()
    await consumer.start()
    tp = TopicPartition(topic, partition)
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    out = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, b"x%d" % i, partition=partition)
            while True:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                if any(m.value == b"x%d" % i for m in batch.get(tp, [])):
                    break
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        await consumer.stop()
        await producer.stop()
    return out


async def pipeline(url: str, model: str, rate: float, n: int) -> tuple[list[float], int]:
    """Send ``n`` requests at ``rate``/s; returns (latencies ms, failures)."""
    latencies: list[float] = []
    failures = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def one(i: int) -> None:
            nonlocal failures
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": f"ping {i}"}]})
            if r.status_code == 200:
                latencies.append((time.perf_counter() - t0) * 1000)
            else:
                failures += 1

        tasks = []
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return latencies, failures


async def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    model = "bench-mocker"
    sup = Supervisor(Settings(namespace="bench"),
                     WorkerSpec(engine="mocker", model=model, extra_args=["--speedup-ratio", "1e9"]),
                     port=free_port())
    await sup.start()
    try:
        for _ in range(args.workers):
            await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(args.workers, timeout_s=120)
        await pipeline(sup.url, model, rate=50, n=20)  # warm-up
        lat, failures = await pipeline(sup.url, model, args.rate, args.requests)
        bare = await bare_round_trip(sup.settings, sup.catalog.responses.name, sup.catalog.responses.partitions - 1,
                                     n=200)
    finally:
        await sup.stop()
    return {
        "bench": "pipeline_overhead", "broker": "embedded-tansu", "workers": args.workers,
        "rate_rps": args.rate, "requests": args.requests, "failed": failures,
        "pipeline_p50_ms": round(pct(lat, 50), 2), "pipeline_p99_ms": round(pct(lat, 99), 2),
        "pipeline_mean_ms": round(statistics.fmean(lat), 2),
        "bare_roundtrip_p50_ms": round(pct(bare, 50), 2), "bare_roundtrip_p99_ms": round(pct(bare, 99), 2),
        "ratio_p50": round(pct(lat, 50) / pct(bare, 50), 2),
        "kafka_hops": 3,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
