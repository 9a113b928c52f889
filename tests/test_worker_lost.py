"""A worker that dies mid-request: the router answers its requests
``worker_lost`` once it expires the worker, and the client resubmits each
with the output delivered so far (migration), so the caller sees one
uninterrupted stream; with migration off the caller gets the 503."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from kvflow.router.orphans import Orphans, Routed
from kvflow.schemas import (
    FinalResponse,
    FinishReason,
    MediaItem,
    MediaKind,
    ReplyTo,
    SamplingParams,
    TokenDelta,
    WorkerHeartbeat,
    WorkerRole,
    encode,
    now_ms,
)
from kvflow.streams.client import KvflowClient
from kvflow.streams.kafka import make_producer
from kvflow.supervisor import WorkerSpec
from kvflow.workers.engines.mocker_core import MockerConfig

from deployment import KILLED_WORKER_TTL_MS, in_process_cluster, running_deployment

MODEL = "SmolLM2-135M-Instruct"
R = ReplyTo(topic="responses", partition=3)


def test_orphans_forget_finished_and_hand_back_lost_ones():
    o = Orphans(limit=3)
    o.note(Routed("a", "w1", None, R))
    o.note(Routed("b", "w2", None, R))
    o.note(Routed("c", "w3", "w1", R))  # remote prefill on w1
    o.finished("b", "w2")
    assert [r.request_id for r in o.take_lost(["w1"])] == ["a", "c"]  # c's prefill was not done
    assert len(o) == 0 and o.take_lost(["w1"]) == []
    for i in range(5):
        o.note(Routed(f"r{i}", "w", None, R))
    assert len(o) == 3 and [r.request_id for r in o.take_lost({"w"})] == ["r2", "r3", "r4"]


def test_a_finished_prefill_or_a_forwarded_encode_no_longer_ties_a_request_to_its_worker():
    o = Orphans()
    o.note(Routed("p", "d1", "p1", R))  # remote prefill on p1, decode on d1
    o.finished("p", "p1")  # the prefill is done: the request is d1's now
    assert o.take_lost(["p1"]) == [] and len(o) == 1
    o.note(Routed("e", "w1", None, R, encode_worker_id="enc"))
    o.note(Routed("f", "w1", None, R, encode_worker_id="enc"))
    o.admitted("e", "w9")  # not its worker: still with the encoder
    o.admitted("e", "w1")  # its worker took it: the encoder sent it on
    assert [r.request_id for r in o.take_lost(["enc"])] == ["f"]
    assert [r.request_id for r in o.take_lost(["d1", "w1"])] == ["p", "e"]


async def kill_serving_worker(sup, worker_id: str) -> None:
    child = sup.children.pop(worker_id)
    child.process.send_signal(signal.SIGKILL)
    await child.process.wait()


async def stream_killing_the_worker(sup, client, req) -> tuple[list[TokenDelta], FinalResponse]:
    """Stream ``req``; SIGKILL the worker serving it at its first delta."""
    deltas, final, killed = [], None, False
    async with contextlib.aclosing(client.stream(req)) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                deltas.append(event)
                if not killed:
                    killed = True
                    await kill_serving_worker(sup, event.worker_id)
            else:
                final = event
    return deltas, final


async def test_without_migration_a_killed_workers_request_ends_worker_lost(kafka):
    settings, _ = kafka
    settings = settings.model_copy(update={"max_migrations": 0})
    # Slow decode (speedup 0.05): the request is still streaming when its worker is killed.
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "0.05"])
    async with running_deployment(settings, spec, workers=1, bridge=False,
                                  worker_ttl_ms=KILLED_WORKER_TTL_MS) as sup:
        async with KvflowClient(sup.settings, sup.catalog, timeout_s=120) as client:
            req = client.new_request(MODEL, prompt="tell me a long story", sampling=SamplingParams(max_tokens=4000))
            _, final = await stream_killing_the_worker(sup, client, req)
            assert final is not None and final.finish_reason is FinishReason.error, final
            assert final.error.code == "worker_lost" and final.error.status == 503
            assert sup.router.counters["worker_lost"] == 1 and client.migrations == 0

            # A new worker serves the next request.
            await sup.start_worker()
            await sup.wait_workers_ready(1)
            ok = await asyncio.wait_for(client.complete(client.new_request(
                MODEL, prompt="hi", sampling=SamplingParams(max_tokens=2))), 120)
            assert ok.finish_reason is FinishReason.length


async def test_a_killed_workers_request_migrates_and_matches_an_uninterrupted_run(kafka):
    settings, _ = kafka
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "0.2"])
    async with running_deployment(settings, spec, workers=2, bridge=False,
                                  worker_ttl_ms=KILLED_WORKER_TTL_MS) as sup:
        async with KvflowClient(sup.settings, sup.catalog, timeout_s=120) as client:
            req = client.new_request(MODEL, prompt="tell me a long story", token_ids=list(range(1, 300)),
                                     sampling=SamplingParams(max_tokens=300))
            deltas, final = await stream_killing_the_worker(sup, client, req)
            assert final is not None and final.error is None, final
            assert final.finish_reason is FinishReason.length and client.migrations == 1
            streamed = [t for d in deltas for t in d.token_ids]
            assert [d.index for d in deltas] == list(range(len(deltas)))  # one stream
            assert streamed == final.token_ids and len(final.token_ids) == 300  # nothing lost or repeated
            assert final.usage.completion_tokens == 300 and final.usage.prompt_tokens == 299
            assert "".join(d.text for d in deltas) == final.text

            # The same request (same id: the mocker's output depends on it) served without a fault.
            again = await asyncio.wait_for(client.complete(req), 120)
            assert again.error is None and again.token_ids == final.token_ids


async def test_a_request_whose_encode_worker_died_ends_worker_lost(kafka, waiter):
    """An encode worker that dies before sending a request on: once it expires, the
    router answers the request ``worker_lost`` (it used to wait for its deadline)."""
    settings, catalog = kafka
    settings = settings.model_copy(update={"max_migrations": 0})
    model = "mock-vlm-lost"
    async with in_process_cluster(settings, catalog, waiter, model=model, mocker=MockerConfig(block_size=16),
                                  client_timeout_s=300) as (router, _, client):
        # A heartbeat with no process behind it: the encoder that died right after it.
        gone = WorkerHeartbeat(worker_id="enc-gone", role=WorkerRole.encode, model=model, engine="media",
                               block_size=1, kv_total_blocks=0, queue_topic=catalog.queue(WorkerRole.encode).name,
                               queue_partition=0, ts_ms=now_ms(), ttl_ms=3_000, started_ms=1)
        producer = make_producer(settings)
        await producer.start()
        try:
            await producer.send_and_wait(catalog.workers.name, encode(gone), key=b"enc-gone")
        finally:
            await producer.stop()
        await waiter(lambda: "enc-gone" in router.table.workers, timeout_s=60)
        image = MediaItem(kind=MediaKind.image, content_type="image/png", content_hash=7, offset=2, num_tokens=8,
                          data="iVBORw0KGgo=")
        req = client.new_request(model, token_ids=list(range(40)), media=[image],
                                 sampling=SamplingParams(max_tokens=4), deadline_ms=now_ms() + 600_000)
        final = await client.complete(req)
        assert final.finish_reason is FinishReason.error and final.error.code == "worker_lost", final.error
        assert final.worker_id == "enc-gone" and router.counters["worker_lost"] == 1
