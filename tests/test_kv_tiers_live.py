"""Live KV tiers: `kvflow up --engine hf --kv-host-gb 1` with a tiny G1. A prompt evicted from G1 and
asked again is served from host memory: its cached tokens exceed what G1 can hold, and the worker's
metrics record reports the onboarded blocks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from aiokafka import TopicPartition

from deployment import running_deployment
from kvflow.schemas import MetricRecord, WorkerMetrics, decode
from kvflow.streams.kafka import make_consumer
from kvflow.supervisor import WorkerSpec

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
G1_BLOCKS, BS = 8, 16


def text(kind: str) -> str:
    words = {"p": ["amber", "silver", "quiet", "northern"], "q": ["red", "green", "blue", "yellow"],
             "r": ["stone", "glass", "paper", "iron"]}[kind]
    return " ".join(f"Item {i}: the {w} bridge number {i * 7} stands near the old market square."
                    for i, w in enumerate(words * 3))


@pytest.fixture(scope="module")
async def tiered(broker):
    from kvflow.settings import Settings
    from kvflow.streams.catalog import Catalog
    from kvflow.streams.kafka import create_topics

    settings = Settings(bootstrap_servers=broker.bootstrap_servers, embedded_broker=True,
                        namespace=f"tier{uuid.uuid4().hex[:8]}", session_timeout_ms=2000,
                        # G1 is tiny and always full of cached blocks: never shed for KV use, hold instead.
                        shed_kv_threshold=1.0, shed_mode="queue")
    catalog = Catalog(settings.namespace)
    await create_topics(settings, catalog)
    spec = WorkerSpec(engine="hf", model=MODEL, extra_args=["--kv-host-gb=1", f"--num-kv-blocks={G1_BLOCKS}"])
    async with running_deployment(settings, spec, workers=1, ready_timeout_s=240) as sup:
        yield sup, settings, catalog


async def ask(http: httpx.AsyncClient, content: str) -> tuple[int, float, str]:
    """Stream one greedy chat request; returns (cached prompt tokens, TTFT s, text)."""
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4,
            "temperature": 0, "messages": [{"role": "user", "content": content}]}
    t0 = time.perf_counter()
    ttft, chunks = None, []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                chunks.append(chunk)
    usage = chunks[-1]["usage"]
    out = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return usage["prompt_tokens_details"]["cached_tokens"], ttft, out


async def onboarded_in_metrics(settings, catalog, timeout_s: float = 60.0) -> int:
    """Largest ``kv_tiers.onboarded_host_blocks`` among WorkerMetrics records, read until positive."""
    consumer = make_consumer(settings)
    await consumer.start()
    best = 0
    try:
        tps = [TopicPartition(catalog.metrics.name, p) for p in range(catalog.metrics.partitions)]
        consumer.assign(tps)
        for tp in tps:
            await consumer.seek_to_beginning(tp)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and not best:
            for msgs in (await consumer.getmany(*tps, timeout_ms=500)).values():
                for msg in msgs:
                    rec = decode(MetricRecord, msg.value)
                    if isinstance(rec, WorkerMetrics) and rec.kv_tiers is not None:
                        best = max(best, rec.kv_tiers.onboarded_host_blocks)
        return best
    finally:
        await consumer.stop()


async def test_prompt_evicted_from_g1_is_onboarded_from_host(tiered):
    sup, settings, catalog = tiered
    async with httpx.AsyncClient(base_url=sup.url, timeout=300) as http:
        cold_cached, cold_ttft, cold_text = await ask(http, text("p"))
        assert cold_cached == 0
        await ask(http, text("q"))  # pushes p's blocks out of the 8-block G1, into host memory
        warm_cached, warm_ttft, warm_text = await ask(http, text("p"))
        other_cached, other_ttft, _ = await ask(http, text("r"))  # a cold prompt of about the same length
    assert warm_text == cold_text  # same greedy output from the onboarded KV
    assert warm_cached > G1_BLOCKS * BS  # more than G1 can hold: the rest came back from host memory
    assert other_cached < warm_cached
    assert await onboarded_in_metrics(settings, catalog) >= warm_cached // BS - G1_BLOCKS
    print(f"TTFT cold {cold_ttft * 1000:.0f} ms, onboarded {warm_ttft * 1000:.0f} ms "
          f"({warm_cached} cached tokens), other cold prompt {other_ttft * 1000:.0f} ms ({other_cached} cached)")
