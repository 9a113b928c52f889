"""Request deadlines end to end on the real embedded broker.

A router and one mocker worker that runs one request at a time
(``max_num_seqs`` 1) serve in this process behind the HTTP bridge (uvicorn),
so the tests can read the worker's counters and engine while every record
goes through Kafka. A ``LONG`` request decodes for ~30 s; each test gives
its request a deadline of a second or two and checks that the answer, the
worker and the bridge's metrics all end it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from aiokafka import TopicPartition
from deployment import in_process_cluster, read_final, serve_bridge

from kvflow.schemas import (
    DEADLINE_EXCEEDED,
    CancelReason,
    CancelRequest,
    FinishReason,
    SamplingParams,
    WorkerHeartbeat,
    decode,
    encode,
    now_ms,
)
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.workers.engines.mocker_core import MockerConfig

MODEL = "mock-deadline"
LONG = 5000
"""max_tokens of a request that cannot finish before its deadline (~30 s of mocker decode)."""
BRIDGE_SLOT = 7


@pytest.fixture
async def cluster(kafka, waiter):
    """``(settings, catalog, worker, client)``: one worker running one request at a time."""
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=1.0, block_size=16, num_kv_blocks=1024, max_num_seqs=1)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker, workers=1,
                                  client_timeout_s=20) as (_, workers, client):
        yield settings, catalog, workers[0], client


@pytest.fixture
async def bridge(cluster):
    settings, catalog, _, _ = cluster
    async with serve_bridge(settings, catalog, BRIDGE_SLOT) as served:
        yield served


def chat(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": max_tokens, "stream": stream}


async def engine_idle(worker, waiter) -> None:
    stats = worker.engine.kv_stats
    await waiter(lambda: stats().active_requests == 0 and stats().waiting_requests == 0 and stats().used_blocks == 0,
                 timeout_s=5)


async def read_cancels(settings, catalog, timeout_s: float = 3.0) -> list[CancelRequest]:
    """Every record of the cancels topic, read for ``timeout_s``."""
    consumer = make_consumer(settings)
    await consumer.start()
    out: list[CancelRequest] = []
    try:
        tps = [TopicPartition(catalog.cancels.name, p) for p in range(catalog.cancels.partitions)]
        consumer.assign(tps)
        for tp in tps:
            await consumer.seek_to_beginning(tp)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            for msgs in (await consumer.getmany(*tps, timeout_ms=200)).values():
                out.extend(decode(CancelRequest, m.value) for m in msgs)
        return out
    finally:
        await consumer.stop()


def outcome(state, endpoint: str, outcome_: str, reason: str) -> float | None:
    return state.metrics.registry.get_sample_value(
        "kvflow_bridge_outcomes_total", {"endpoint": endpoint, "outcome": outcome_, "reason": reason})


async def test_stream_past_its_deadline_ends_with_an_error_event_and_the_worker_stops(cluster, bridge, waiter):
    settings, catalog, worker, _ = cluster
    url, state = bridge
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=chat(LONG, stream=True),
                               headers={"X-Request-Timeout": "1.5"}) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            data = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                    async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == DEADLINE_EXCEEDED
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in data[:-2])
    assert text  # tokens streamed before the deadline

    final = await read_final(settings, catalog, BRIDGE_SLOT, request_id)
    assert final.finish_reason is FinishReason.error and final.error.code == DEADLINE_EXCEEDED
    assert final.error.status == 504 and 0 < final.usage.completion_tokens < LONG // 2
    assert final.text.startswith(text) and len(final.token_ids) == final.usage.completion_tokens
    assert worker.expired == 1 and worker.aborted == 0
    await engine_idle(worker, waiter)
    await waiter(lambda: outcome(state, "chat", "deadline", "after_first_token") == 1)


async def test_request_waiting_behind_another_is_answered_504_at_its_deadline(cluster, bridge, waiter):
    settings, catalog, worker, client = cluster
    url, state = bridge
    # The one running slot of the worker's engine is taken for ~30 s.
    blocker = client.new_request(MODEL, prompt="hog the engine", sampling=SamplingParams(max_tokens=LONG))
    hog = client.stream(blocker)
    await hog.__anext__()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "waiting", "max_tokens": 10},
                                   headers={"X-Request-Timeout": "1"})
        assert resp.status_code == 504 and resp.json()["error"]["code"] == DEADLINE_EXCEEDED
        request_id = resp.headers["x-request-id"]
        final = await read_final(settings, catalog, BRIDGE_SLOT, request_id)  # the worker gave it up too
        assert final.error.code == DEADLINE_EXCEEDED and final.usage.completion_tokens == 0
        assert worker.expired == 1
        await waiter(lambda: outcome(state, "completions", "deadline", "before_first_token") == 1)
    finally:
        await client.cancel(blocker.request_id)
        await hog.aclose()
    await engine_idle(worker, waiter)


async def test_worker_ends_a_request_at_its_deadline_with_nobody_waiting(cluster, waiter):
    settings, catalog, worker, client = cluster
    req = client.new_request(MODEL, prompt="fire and forget", sampling=SamplingParams(max_tokens=LONG),
                             deadline_ms=now_ms() + 3000)
    await client.submit(req)  # no stream: nobody gives up on it, nobody sends a cancel
    final = await read_final(settings, catalog, client.slot, req.request_id, timeout_s=30)
    # Usually ended mid-generation; on a loaded machine possibly before its first token.
    assert final.error.code == DEADLINE_EXCEEDED and 0 <= final.usage.completion_tokens < LONG // 2
    assert worker.expired == 1
    await engine_idle(worker, waiter)
    assert await read_cancels(settings, catalog, timeout_s=1.0) == []


async def test_request_never_dispatched_is_answered_at_its_deadline(kafka):
    """No router runs: the request stays on the requests topic. The bridge's
    own deadline answers it and publishes a deadline cancel."""
    settings, catalog = kafka
    producer = make_producer(settings)
    await producer.start()

    async def heartbeats() -> None:  # a worker the bridge believes in, which never gets the request
        while True:
            hb = WorkerHeartbeat(worker_id="ghost", model=MODEL, engine="mocker", tokenizer="bytes", block_size=16,
                                 kv_total_blocks=100, queue_topic=catalog.queue("aggregated").name,
                                 queue_partition=0, ts_ms=now_ms(), ttl_ms=settings.worker_ttl_ms)
            await producer.send_and_wait(catalog.workers.name, encode(hb), key=b"ghost")
            await asyncio.sleep(settings.heartbeat_interval_ms / 1000)

    beating = asyncio.create_task(heartbeats())
    try:
        async with serve_bridge(settings, catalog, BRIDGE_SLOT) as (url, state):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                resp = await http.post("/v1/chat/completions", json=chat(20, stream=True),
                                       headers={"X-Request-Timeout": "1"})
            assert resp.status_code == 504 and resp.json()["error"]["code"] == DEADLINE_EXCEEDED
            assert outcome(state, "chat", "deadline", "before_first_token") == 1
            request_id = resp.headers["x-request-id"]
            (cancel,) = await read_cancels(settings, catalog)
            assert cancel.request_id == request_id and cancel.reason is CancelReason.deadline_exceeded
            assert cancel.requested_by == f"bridge:{BRIDGE_SLOT}"
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await producer.stop()


async def test_a_request_past_its_deadline_before_it_starts_counts_once(cluster):
    # Its deadline can pass between the worker taking the request and the engine getting it, before
    # the deadline timer fires: the worker answers it without the engine and counts it as expired,
    # once, whatever deadline cancel comes after.
    from kvflow.workers.worker import _Inflight

    settings, catalog, worker, client = cluster
    req = client.new_request(MODEL, prompt="too late", sampling=SamplingParams(max_tokens=LONG),
                             deadline_ms=now_ms() - 1)
    before = worker.expired
    worker.inflight[req.request_id] = _Inflight(req, asyncio.current_task(), now_ms())
    try:
        await worker._generate(req, now_ms())
        assert worker.expired == before + 1
        assert await worker.cancel(worker._deadline_cancel(req)) is False  # the timer's cancel, late
        assert worker.expired == before + 1 and worker.aborted == 0
    finally:
        worker.inflight.pop(req.request_id, None)
    final = await read_final(settings, catalog, client.slot, req.request_id, timeout_s=30)
    assert final.error.code == DEADLINE_EXCEEDED and final.usage.completion_tokens == 0
