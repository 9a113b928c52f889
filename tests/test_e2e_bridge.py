"""The whole deployment as `kvflow up` runs it, on the real embedded broker:
HTTP bridge → router → worker processes (mocker engine) → bridge; the
`openai` package as the client; the Kafka-native client with no bridge."""

import asyncio

import httpx
import openai
import pytest

from kvflow.schemas import ChatMessage, SamplingParams
from kvflow.streams.client import KvflowClient
from kvflow.supervisor import WorkerSpec
from deployment import running_deployment

MODEL = "mock-e2e"
SPEC = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "20", "--num-kv-blocks", "2048",
                                                             "--block-size", "16"])


@pytest.fixture
async def deployment(kafka):
    settings, catalog = kafka
    async with running_deployment(settings, SPEC, workers=2) as sup:
        yield sup


async def test_openai_client_streaming_and_non_streaming(deployment):
    client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused")
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=7, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 7
    assert reply.usage.prompt_tokens > 0
    assert len(reply.choices[0].message.content) == 7  # mocker text: one letter or space per token

    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 6
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []

    comp = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
    assert comp.usage.completion_tokens == 4 and len(comp.choices[0].text) == 4


async def test_concurrent_http_requests_use_both_workers(deployment):
    client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused")
    replies = await asyncio.gather(*(
        client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8)
        for i in range(20)))
    bodies = [r.http_response.json() for r in replies]
    assert all(b["usage"]["completion_tokens"] == 8 for b in bodies)
    assert len({b["kvflow"]["worker_id"] for b in bodies}) == 2


async def test_http_errors_are_openai_shaped(deployment):
    async with httpx.AsyncClient(base_url=deployment.url) as http:
        bad = await http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        missing = await http.post("/v1/chat/completions", json={"model": MODEL})
        assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
        unknown = await http.post("/v1/chat/completions",
                                  json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        huge = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 40000})
        assert huge.status_code == 413
    # drain both workers: the model is known but nothing serves it → 503 with Retry-After
    for worker_id in list(deployment.children):
        await deployment.stop_worker(worker_id)
    async with httpx.AsyncClient(base_url=deployment.url) as http:
        for _ in range(100):
            r = await http.post("/v1/chat/completions",
                                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            if r.status_code == 503:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert r.json()["error"]["message"]


async def test_kafka_native_client_without_bridge(kafka):
    settings, catalog = kafka
    async with running_deployment(settings, SPEC, workers=1, bridge=False):
        async with KvflowClient(settings, catalog, timeout_s=30) as client:
            final = await client.complete(client.new_request(
                MODEL, messages=[ChatMessage(role="user", content="no http here")],
                sampling=SamplingParams(max_tokens=5)))
    assert final.error is None and final.usage.completion_tokens == 5 and len(final.text) == 5
