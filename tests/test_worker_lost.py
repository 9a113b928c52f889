"""A worker that dies mid-request: its requests are answered ``worker_lost``
(retryable 503) once the router expires it, instead of waiting for the
request timeout; another worker then serves new requests."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from kvflow.router.orphans import Orphans, Routed
from kvflow.schemas import FinalResponse, FinishReason, ReplyTo, SamplingParams, TokenDelta
from kvflow.streams.client import KvflowClient
from kvflow.supervisor import WorkerSpec

from deployment import running_deployment

MODEL = "SmolLM2-135M-Instruct"
R = ReplyTo(topic="responses", partition=3)


def test_orphans_forget_finished_and_hand_back_lost_ones():
    o = Orphans(limit=3)
    o.note(Routed("a", "w1", None, R))
    o.note(Routed("b", "w2", None, R))
    o.note(Routed("c", "w3", "w1", R))  # remote prefill on w1
    o.finished("b", "w2")
    o.finished("c", "w1")  # the prefill worker's finish record is not the end
    assert [r.request_id for r in o.take_lost(["w1"])] == ["a", "c"]
    assert len(o) == 0 and o.take_lost(["w1"]) == []
    for i in range(5):
        o.note(Routed(f"r{i}", "w", None, R))
    assert len(o) == 3 and [r.request_id for r in o.take_lost({"w"})] == ["r2", "r3", "r4"]


async def test_requests_of_a_killed_worker_end_with_worker_lost(kafka):
    settings, _ = kafka
    # Slow decode (speedup 0.05): the request is still streaming when its worker is killed.
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "0.05"])
    async with running_deployment(settings, spec, workers=1, bridge=False) as sup:
        async with KvflowClient(sup.settings, sup.catalog, timeout_s=120) as client:
            req = client.new_request(MODEL, prompt="tell me a long story", sampling=SamplingParams(max_tokens=4000))
            final = None
            async with contextlib.aclosing(client.stream(req)) as events:
                async for event in events:
                    if isinstance(event, TokenDelta) and sup.children:
                        child = next(iter(sup.children.values()))
                        child.process.send_signal(signal.SIGKILL)
                        await child.process.wait()
                        del sup.children[child.worker_id]
                    elif isinstance(event, FinalResponse):
                        final = event
            assert final is not None and final.finish_reason is FinishReason.error, final
            assert final.error.code == "worker_lost" and final.error.status == 503
            assert sup.router.counters["worker_lost"] == 1

            # A new worker serves the next request.
            await sup.start_worker()
            await sup.wait_workers_ready(1)
            ok = await asyncio.wait_for(client.complete(client.new_request(
                MODEL, prompt="hi", sampling=SamplingParams(max_tokens=2))), 120)
            assert ok.finish_reason is FinishReason.length
