"""Request cancellation end to end on the real embedded broker.

Router (Faust app), two mocker workers and the HTTP bridge (uvicorn) run in
this process, so the tests can look at the workers' abort counters, their
engines' KV blocks and the bridge's Prometheus series, while every record
still goes through Kafka: bridge/client → cancels topic → workers → final
``abort`` response on the responses topic.

The mocker runs at real speed (``speedup_ratio`` 1, about 6 ms per decode
step), so a ``LONG`` request would take ~30 s; a cancelled one ends within
a few dozen tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from aiokafka import TopicPartition
from deployment import in_process_cluster, read_final, serve_bridge, steady

from kvflow.schemas import (
    DeadLetter,
    FinalResponse,
    FinishReason,
    MetricRecord,
    SamplingParams,
    TokenDelta,
    WorkerMetrics,
    decode,
    encode,
)
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig
from kvflow.workers.worker import Worker, WorkerConfig

MODEL = "mock-cancel"
LONG = 5000
"""max_tokens of a request meant to be cancelled (~30 s of mocker decode)."""
BRIDGE_SLOT = 7
"""Responses partition of the bridge, read back by the tests."""


@pytest.fixture
async def cluster(kafka, waiter):
    """``(settings, catalog, [worker w0, worker w1], client)`` behind a round-robin router."""
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=1.0, block_size=16, num_kv_blocks=1024)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker,
                                  client_timeout_s=20) as (_, workers, client):
        yield settings, catalog, workers, client


@pytest.fixture
async def bridge(cluster):
    """``(url, bridge state)`` of a bridge on ``BRIDGE_SLOT`` in front of ``cluster``; it cancels a
    disconnected stream at once (no grace for a resume, see tests/test_resume.py)."""
    settings, catalog, _, _ = cluster
    async with serve_bridge(settings.model_copy(update={"stream_resume_grace_s": 0}), catalog,
                            BRIDGE_SLOT) as served:
        yield served


async def read_dead_letters(settings, catalog, count: int, timeout_s: float = 10.0) -> list[DeadLetter]:
    """The first ``count`` records of the dead-letter topic."""
    consumer = make_consumer(settings)
    await consumer.start()
    found: list[DeadLetter] = []
    try:
        tp = TopicPartition(catalog.dead_letter.name, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(found) < count and asyncio.get_running_loop().time() < deadline:
            for msg in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                found.append(decode(DeadLetter, msg.value))
        return found
    finally:
        await consumer.stop()


async def aborted_in_metrics(settings, catalog, worker_id: str, timeout_s: float = 10.0) -> int:
    """Sum of ``aborted_requests`` over ``worker_id``'s WorkerMetrics records, read from the topic's
    beginning until it is positive (or ``timeout_s`` passes) and then one more snapshot period."""
    consumer = make_consumer(settings)
    await consumer.start()
    total, settle_until = 0, None
    try:
        tps = [TopicPartition(catalog.metrics.name, p) for p in range(catalog.metrics.partitions)]
        consumer.assign(tps)
        for tp in tps:
            await consumer.seek_to_beginning(tp)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < (settle_until or deadline):
            for msgs in (await consumer.getmany(*tps, timeout_ms=200)).values():
                for msg in msgs:
                    rec = decode(MetricRecord, msg.value)
                    if isinstance(rec, WorkerMetrics) and rec.worker_id == worker_id:
                        total += rec.aborted_requests
            if total and settle_until is None:
                settle_until = loop.time() + 2.5  # a later snapshot must not count it again
        return total
    finally:
        await consumer.stop()


def kv_used(workers: list[Worker]) -> int:
    return sum(w.engine.kv_stats().used_blocks for w in workers)


def holder(workers: list[Worker], worker_id: str) -> Worker:
    (worker,) = [w for w in workers if w.config.worker_id == worker_id]
    return worker


async def assert_engines_idle(workers: list[Worker], waiter) -> None:
    """Every engine dropped its requests and every KV block is back in the pool."""
    await waiter(lambda: all(w.engine.kv_stats().active_requests == 0 and w.engine.kv_stats().waiting_requests == 0
                             for w in workers), timeout_s=5)
    await waiter(lambda: kv_used(workers) == 0, timeout_s=5)


def long_chat(stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": LONG, "stream": stream}


# ---------------------------------------------------------------- bridge: client disconnects


async def test_stream_closed_by_client_aborts_the_request_on_its_worker(cluster, bridge, waiter):
    settings, catalog, workers, _ = cluster
    url, state = bridge
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=long_chat(stream=True)) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            data_lines = 0
            async for line in resp.aiter_lines():
                data_lines += line.startswith("data: ")
                if data_lines == 5:  # the role chunk and four tokens
                    break
            assert kv_used(workers) > 0  # the request holds KV blocks while it decodes
        # leaving the block closes the connection mid-stream

    final = await read_final(settings, catalog, BRIDGE_SLOT, request_id)
    assert final.finish_reason is FinishReason.abort and final.error is None
    assert 4 <= final.usage.completion_tokens < LONG // 10
    assert len(final.token_ids) == final.usage.completion_tokens
    owner = holder(workers, final.worker_id)
    assert owner.aborted == 1 and sum(w.aborted for w in workers) == 1
    await assert_engines_idle(workers, waiter)

    get = state.metrics.registry.get_sample_value
    await waiter(lambda: get("kvflow_bridge_cancels_total", {"endpoint": "chat", "result": "sent"}) == 1)
    assert get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "499"}) == 1
    assert get("kvflow_bridge_requests_in_flight", {"endpoint": "chat"}) == 0


async def test_non_streaming_client_gone_before_the_answer_aborts_the_request(cluster, bridge, waiter):
    settings, catalog, workers, _ = cluster
    url, state = bridge
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG}
        post = asyncio.create_task(http.post("/v1/completions", json=body))
        # the request is decoding on some worker: its id is the one in flight
        (busy,) = await waiter(lambda: [w for w in workers if w.inflight])
        (request_id,) = list(busy.inflight)
        await waiter(lambda: busy.engine.kv_stats().active_requests == 1)
        post.cancel()  # the client gives up: httpx closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await post

    final = await read_final(settings, catalog, BRIDGE_SLOT, request_id)
    assert final.finish_reason is FinishReason.abort and final.worker_id == busy.config.worker_id
    assert final.usage.completion_tokens < LONG // 10
    assert busy.aborted == 1
    await assert_engines_idle(workers, waiter)
    get = state.metrics.registry.get_sample_value
    await waiter(lambda: get("kvflow_bridge_cancels_total", {"endpoint": "completions", "result": "sent"}) == 1)
    assert get("kvflow_bridge_requests_total", {"endpoint": "completions", "status": "499"}) == 1


async def test_finished_requests_send_no_cancel(cluster, bridge, waiter):
    _, _, workers, _ = cluster
    url, state = bridge
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        short = {**long_chat(stream=True), "max_tokens": 6}
        async with http.stream("POST", "/v1/chat/completions", json=short) as resp:
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        reply = await http.post("/v1/chat/completions", json={**long_chat(stream=False), "max_tokens": 6})
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        get = state.metrics.registry.get_sample_value
        assert get("kvflow_bridge_cancels_total", {"endpoint": "chat", "result": "sent"}) is None

        # A marker: a third request whose client goes away sends the one cancel this test expects.
        # The bridge sends cancels in order and every worker reads them in order, so once both
        # workers have seen the marker's cancel, a (wrong) cancel of the two finished requests
        # would have reached them before it.
        post = asyncio.create_task(http.post("/v1/chat/completions", json=long_chat(stream=False)))
        (busy,) = await waiter(lambda: [w for w in workers if w.inflight])
        (marker,) = list(busy.inflight)
        await waiter(lambda: busy.engine.kv_stats().active_requests == 1)
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post
    (idle,) = [w for w in workers if w is not busy]
    await waiter(lambda: busy.aborted == 1 and marker in idle.early_cancels)
    assert get("kvflow_bridge_cancels_total", {"endpoint": "chat", "result": "sent"}) == 1
    assert get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "200"}) == 2
    assert list(idle.early_cancels) == [marker] and not busy.early_cancels


# ---------------------------------------------------------------- Kafka-native client


async def test_client_cancel_of_an_inflight_request_ends_it_with_abort(cluster, waiter):
    settings, catalog, workers, client = cluster
    req = client.new_request(MODEL, prompt="a long story", sampling=SamplingParams(max_tokens=LONG))
    events: list[TokenDelta | FinalResponse] = []
    async with contextlib.aclosing(client.stream(req)) as stream:
        async for event in stream:
            events.append(event)
            if len(events) == 3:
                await client.cancel(req.request_id)
    deltas, final = events[:-1], events[-1]
    assert isinstance(final, FinalResponse) and final.finish_reason is FinishReason.abort
    assert all(isinstance(d, TokenDelta) for d in deltas)
    assert final.usage.completion_tokens == sum(len(d.token_ids) for d in deltas)
    assert 3 <= final.usage.completion_tokens < LONG // 10
    owner = holder(workers, final.worker_id)
    other = next(w for w in workers if w is not owner)
    assert owner.aborted == 1 and other.aborted == 0
    await waiter(lambda: req.request_id in other.early_cancels)  # the other worker read it and let it be
    assert other.aborted == 0
    await assert_engines_idle(workers, waiter)
    # the worker's metrics snapshots on the metrics topic report the abort (once)
    assert await aborted_in_metrics(settings, catalog, owner.config.worker_id) == 1


async def test_cancel_that_overtakes_its_request_aborts_it_on_arrival(cluster, waiter):
    _, _, workers, client = cluster
    req = client.new_request(MODEL, prompt="too late", sampling=SamplingParams(max_tokens=LONG))
    await client.cancel(req.request_id)
    await waiter(lambda: all(req.request_id in w.early_cancels for w in workers))
    final = await asyncio.wait_for(client.complete(req), 10)
    assert final.finish_reason is FinishReason.abort and final.usage.completion_tokens == 0
    assert holder(workers, final.worker_id).aborted == 1
    assert all(w.engine.kv_stats().prefill_tokens_total == 0 for w in workers)  # never reached an engine


async def test_cancel_of_an_unknown_request_is_harmless(cluster, waiter):
    _, _, workers, client = cluster
    await client.cancel("req-nobody-sent-this")
    await waiter(lambda: all("req-nobody-sent-this" in w.early_cancels for w in workers))
    finals = await asyncio.gather(*(client.complete(client.new_request(
        MODEL, prompt=f"after the cancel {i}", sampling=SamplingParams(max_tokens=5))) for i in range(4)))
    assert all(f.finish_reason is FinishReason.length and f.usage.completion_tokens == 5 for f in finals)
    assert {f.worker_id for f in finals} == {"w0", "w1"}
    assert [w.aborted for w in workers] == [0, 0]
    assert [w.dlq.count for w in workers] == [0, 0]


async def test_worker_started_on_a_backlog_aborts_requests_cancelled_before_it_started(cluster, waiter):
    """Slot 2 has a committed position and, behind it, a request whose cancel
    was sent while no worker held the slot: the worker started there reads the
    recent cancels back and answers that request ``abort`` without running it."""
    settings, catalog, _, client = cluster
    queue = catalog.queue("aggregated")
    tp = TopicPartition(queue.name, 2)
    group = f"{settings.namespace}.worker.aggregated.2"
    placer = make_consumer(settings, group_id=group, enable_auto_commit=False)
    await placer.start()
    try:  # an earlier worker of slot 2 had read up to here
        placer.assign([tp])
        end = (await placer.end_offsets([tp]))[tp]
        await placer.commit({tp: end})
    finally:
        await placer.stop()
    cancelled = client.new_request(MODEL, prompt="cancelled while queued", sampling=SamplingParams(max_tokens=40))
    kept = client.new_request(MODEL, prompt="still wanted", sampling=SamplingParams(max_tokens=4))
    producer = make_producer(settings)
    await producer.start()
    try:
        for req in (cancelled, kept):
            await producer.send_and_wait(queue.name, encode(req), key=req.request_id.encode(), partition=2)
    finally:
        await producer.stop()
    await client.cancel(cancelled.request_id)

    engine = MockerEngine(MockerConfig(speedup_ratio=1.0, block_size=16, num_kv_blocks=1024),
                          worker_id="w2", model_name=MODEL)
    late = Worker(steady(settings), WorkerConfig(worker_id="w2", slot=2, model=MODEL), engine, catalog)
    task = asyncio.create_task(late.run())
    try:
        final = await read_final(settings, catalog, client.slot, cancelled.request_id)
        assert final.finish_reason is FinishReason.abort and final.usage.completion_tokens == 0
        assert final.worker_id == "w2" and late.aborted == 1
        other = await read_final(settings, catalog, client.slot, kept.request_id)
        assert other.finish_reason is FinishReason.length and other.usage.completion_tokens == 4
        assert engine.kv_stats().prefill_tokens_total == other.usage.prompt_tokens  # the cancelled one never ran
    finally:
        late.stop()
        await task


# ---------------------------------------------------------------- malformed cancels


async def test_malformed_cancels_are_dead_lettered_and_cancels_keep_working(cluster, waiter):
    settings, catalog, workers, client = cluster
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(catalog.cancels.name, b"garbage", key=b"x")
        await producer.send_and_wait(catalog.cancels.name, json.dumps({"request_id": "r1"}).encode(), key=b"r1")
    finally:
        await producer.stop()
    # every worker reads the whole cancels topic and skips both; the router dead-letters each once
    await waiter(lambda: [w.malformed_cancels for w in workers] == [2, 2])
    # ask for more than two: a copy per worker would show up as four
    letters = await read_dead_letters(settings, catalog, 4, timeout_s=3.0)
    assert len(letters) == 2 and {d.source_topic for d in letters} == {catalog.cancels.name}
    assert len({d.consumer for d in letters}) == 1 and letters[0].consumer not in ("w0", "w1")
    assert sorted(d.value for d in letters) == sorted(["garbage", '{"request_id": "r1"}'])
    assert [w.dlq.count for w in workers] == [0, 0]

    # the workers still serve, and their cancel consumers still cancel
    finals = await asyncio.gather(*(client.complete(client.new_request(
        MODEL, prompt=f"still here {i}", sampling=SamplingParams(max_tokens=4))) for i in range(2)))
    assert all(f.finish_reason is FinishReason.length for f in finals)
    req = client.new_request(MODEL, prompt="cancel me", sampling=SamplingParams(max_tokens=LONG))
    async with contextlib.aclosing(client.stream(req)) as stream:
        async for event in stream:
            if isinstance(event, TokenDelta):
                await client.cancel(req.request_id)
                break
    final = await read_final(settings, catalog, client.slot, req.request_id)
    assert final.finish_reason is FinishReason.abort and final.usage.completion_tokens < LONG // 10
    assert sum(w.aborted for w in workers) == 1
