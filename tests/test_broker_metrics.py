"""The embedded broker's process series (resident memory, CPU) that `kvflow up` adds to its scrape point."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.schemas import encode
from kvflow.schemas.requests import ReplyTo
from kvflow.streams.broker import EmbeddedBroker, broker_process_registry
from kvflow.streams.kafka import make_producer


def values(registry) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples}


async def test_the_broker_process_series_follow_the_real_broker(broker, kafka):
    settings, catalog = kafka
    registry = broker_process_registry(broker)
    before = values(registry)
    assert before["kvflow_broker_process_resident_memory_bytes"] > 1 << 20
    producer = make_producer(settings)
    await producer.start()
    try:
        blob = encode(ReplyTo(topic="x" * 1000, partition=0))
        for i in range(1000):
            await producer.send(catalog.dead_letter.name, blob, key=str(i).encode())
        await producer.flush()
    finally:
        await producer.stop()
    after = values(registry)
    # Its memory may grow or not (freed heap from deleted topics can take the records); its CPU does.
    assert after["kvflow_broker_process_cpu_seconds_total"] > before["kvflow_broker_process_cpu_seconds_total"]


async def test_a_stopped_broker_has_no_series():
    stopped = EmbeddedBroker()
    assert values(broker_process_registry(stopped)) == {}


def tokio_workers(pid: int) -> int:
    task = Path(f"/proc/{pid}/task")
    return sum((t / "comm").read_text().strip() == "tokio-rt-worker" for t in task.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads from /proc (Linux)")
async def test_the_embedded_broker_runs_the_tokio_workers_it_is_given(monkeypatch, waiter):
    monkeypatch.delenv("TOKIO_WORKER_THREADS", raising=False)
    for threads in (1, 2):
        async with EmbeddedBroker(threads=threads) as broker:
            pid = broker.process.pid
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"TOKIO_WORKER_THREADS={threads}".encode() in environ
            # Tokio's workers may still be starting when the listener accepts (seen once on a
            # loaded machine); blocking-pool threads share the name but start only on demand,
            # and nothing has asked the broker anything yet.
            await waiter(lambda: tokio_workers(pid) == threads, timeout_s=60)
    with pytest.raises(ValueError):
        EmbeddedBroker(threads=0)
