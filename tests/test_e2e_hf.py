"""The real model end to end: SmolLM2-135M-Instruct on two hf worker processes
behind the bridge, on the real embedded broker."""

import asyncio

import httpx
import pytest

from kvflow.supervisor import WorkerSpec
from deployment import running_deployment

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
async def hf_deployment(broker):
    import uuid

    from kvflow.settings import Settings
    from kvflow.streams.catalog import Catalog
    from kvflow.streams.kafka import create_topics

    settings = Settings(bootstrap_servers=broker.bootstrap_servers, embedded_broker=True,
                        namespace=f"hf{uuid.uuid4().hex[:8]}", session_timeout_ms=2000)
    await create_topics(settings, Catalog(settings.namespace))
    async with running_deployment(settings, WorkerSpec(engine="hf", model=MODEL), workers=2,
                                  ready_timeout_s=240) as sup:
        yield sup


async def test_capital_of_france_streams_paris(hf_deployment):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 30,
            "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    import json

    chunks = []
    async with httpx.AsyncClient(base_url=hf_deployment.url, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text
    usage = chunks[-1]["usage"]
    content_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert usage["completion_tokens"] >= len(content_chunks) >= 2
    assert usage["prompt_tokens"] > 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_twenty_concurrent_requests_over_two_hf_workers(hf_deployment):
    async with httpx.AsyncClient(base_url=hf_deployment.url, timeout=300) as http:
        replies = await asyncio.gather(*(
            http.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"Name a color. ({i})"}]})
            for i in range(20)))
    assert [r.status_code for r in replies] == [200] * 20
    bodies = [r.json() for r in replies]
    assert all(b["choices"][0]["message"]["content"] for b in bodies)
    served = {b["kvflow"]["worker_id"] for b in bodies}
    assert len(served) == 2, served
