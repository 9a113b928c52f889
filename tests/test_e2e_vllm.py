"""vLLM end to end: SmolLM2-135M-Instruct on two ``vllm`` worker processes (eager,
vLLM's default dtype, a small KV cache) behind the router and the bridge, on the
real embedded broker, as ``kvflow up --engine vllm --workers 2`` runs them.

Needs vLLM (``bash scripts/install.sh --vllm``): skipped without it, failed in CI.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from deployment import running_deployment
from vllm_support import WORKER_KV_CACHE_GB, require_vllm

from kvflow.supervisor import WorkerSpec

# vLLM engines start in ~20 s on a quiet CPU and several times that on a loaded one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = "Summarise the harbour ledger below in one sentence.\n" + "\n".join(
    f"Day {i}: the ship Marigold-{i} unloaded {i * 37 % 500} barrels of oil, {i * 11 % 90} crates of tea "
    f"and {i * 7 % 40} bales of wool at pier {i % 9}." for i in range(40))
"""A ~1,300-token prompt (about 40 blocks of 32 tokens)."""


@pytest.fixture(scope="module")
async def vllm_deployment(broker):
    require_vllm()
    from kvflow.settings import Settings
    from kvflow.streams.catalog import Catalog
    from kvflow.streams.kafka import create_topics

    settings = Settings(bootstrap_servers=broker.bootstrap_servers, embedded_broker=True,
                        namespace=f"vllm{uuid.uuid4().hex[:8]}", session_timeout_ms=2000, routing_policy="kv")
    await create_topics(settings, Catalog(settings.namespace))
    spec = WorkerSpec(engine="vllm", model=MODEL, extra_args=[f"--kv-cache-gb={WORKER_KV_CACHE_GB}", "--eager"])
    async with running_deployment(settings, spec, workers=2, ready_timeout_s=300) as sup:
        yield sup


async def test_capital_of_france_streams_paris(vllm_deployment):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 30,
            "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    chunks = []
    async with httpx.AsyncClient(base_url=vllm_deployment.url, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] > 10 and usage["completion_tokens"] >= 2


async def test_kafka_native_produce_answers_paris(vllm_deployment, capsys):
    from kvflow.streams.produce import produce_chat

    code = await produce_chat(vllm_deployment.settings, "What is the capital of France?", model=MODEL,
                              max_tokens=30)
    out, err = capsys.readouterr()
    assert code == 0 and "Paris" in out
    assert "[stop]" in err and "worker=" in err


async def test_repeated_long_prompt_is_cached_on_the_same_worker(vllm_deployment):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": LONG_PROMPT}]}
    async with httpx.AsyncClient(base_url=vllm_deployment.url, timeout=120) as http:
        answers = []
        for _ in range(3):  # one after the other: each finished before the next is routed
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            answers.append(resp.json())
    workers = [a["kvflow"]["worker_id"] for a in answers]
    assert len(set(workers)) == 1, f"the repeated prompt moved between workers: {workers}"
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    assert prompt_tokens >= 1000
    for a in answers[1:]:
        cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
        # vLLM caches whole 32-token blocks and recomputes at least the last prompt token.
        assert cached >= prompt_tokens - 2 * 32, f"{cached}/{prompt_tokens} prompt tokens cached"
