"""End to end through the real embedded broker: client → router → mocker workers → client."""

import asyncio

import pytest

from kvflow.schemas import ChatMessage, FinalResponse, FinishReason, SamplingParams, TokenDelta, WorkerRole
from kvflow.streams.kafka import make_producer
from kvflow.workers.engines.mocker_core import MockerConfig

from deployment import in_process_cluster

MODEL = "mock-model"


@pytest.fixture
async def cluster(kafka, waiter):
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=50.0, block_size=16, num_kv_blocks=512)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker) as (router, workers, client):
        yield settings, catalog, router, workers, client


async def test_request_streams_deltas_then_final(cluster):
    settings, catalog, router, workers, client = cluster
    req = client.new_request(MODEL, messages=[ChatMessage(role="user", content="hello there")],
                             sampling=SamplingParams(max_tokens=12))
    events = [e async for e in client.stream(req)]
    deltas, final = events[:-1], events[-1]
    assert isinstance(final, FinalResponse) and final.error is None
    assert all(isinstance(d, TokenDelta) for d in deltas)
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert sum(len(d.token_ids) for d in deltas) == 12 == final.usage.completion_tokens
    assert "".join(d.text for d in deltas) == final.text
    assert final.finish_reason == FinishReason.length
    assert final.usage.prompt_tokens == len(workers[0].tokenizer.encode_chat(req.messages))
    assert final.routing.worker_id == final.worker_id
    assert final.timings.first_token_ms >= final.timings.started_ms


async def test_concurrent_requests_spread_over_both_workers(cluster):
    settings, catalog, router, workers, client = cluster
    reqs = [client.new_request(MODEL, prompt=f"prompt {i}", sampling=SamplingParams(max_tokens=5)) for i in range(20)]
    finals = await asyncio.gather(*(client.complete(r) for r in reqs))
    assert all(f.error is None and f.usage.completion_tokens == 5 for f in finals)
    assert {f.worker_id for f in finals} == {"w0", "w1"}


async def test_malformed_queue_record_does_not_kill_worker(cluster):
    settings, catalog, router, workers, client = cluster
    producer = make_producer(settings)
    await producer.start()
    await producer.send_and_wait(catalog.queue(WorkerRole.aggregated).name, b"garbage", partition=0)
    await producer.stop()
    finals = await asyncio.gather(*(client.complete(client.new_request(MODEL, prompt=f"p{i}",
                                                                       sampling=SamplingParams(max_tokens=2)))
                                    for i in range(4)))
    assert {f.worker_id for f in finals} == {"w0", "w1"}
    assert workers[0].dlq.count == 1


async def test_stop_string_cuts_output(cluster):
    settings, catalog, router, workers, client = cluster
    # find what the mocker will say for this request, then stop on a piece of it
    probe = await client.complete(client.new_request(MODEL, prompt="same", request_id="probe-1",
                                                     sampling=SamplingParams(max_tokens=20)))
    text = probe.text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()), None)
    assert stop, f"mocker text too short to test stops: {text!r}"
    final = await client.complete(client.new_request(MODEL, prompt="same", request_id="probe-1",
                                                     sampling=SamplingParams(max_tokens=20, stop=[stop])))
    assert final.finish_reason == FinishReason.stop
    assert final.text == text[: text.index(stop)]
