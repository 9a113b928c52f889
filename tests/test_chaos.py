"""Chaos: requests through a live deployment while workers are SIGKILLed and
restarted. Every request must end with its full output, equal to a run
without faults, streamed without a lost or repeated token (migration,
``worker_lost`` answers, stale-attempt filtering, predecessors' queue
records skipped)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal

import pytest

from kvflow.schemas import FinalResponse, SamplingParams, TokenDelta
from kvflow.streams.client import KvflowClient
from kvflow.supervisor import WorkerSpec

from deployment import KILLED_WORKER_TTL_MS, running_deployment

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
N_REQUESTS = 160
KILL_EVERY_S = 10.0
CONCURRENCY = 16


def requests(client: KvflowClient) -> list:
    rng = random.Random(7)
    out = []
    for i in range(N_REQUESTS):
        prefix = list(range(1, 1 + 64 * rng.randint(1, 8)))  # shared prefixes, as in a chat trace
        out.append(client.new_request(MODEL, prompt="chaos", token_ids=prefix + [1000 + i] * rng.randint(1, 50),
                                      sampling=SamplingParams(max_tokens=rng.randint(20, 120)),
                                      request_id=f"chaos-{i}"))
    return out


async def run_all(client: KvflowClient, reqs: list, pace_s: float) -> dict[str, tuple[list[int], FinalResponse]]:
    """Stream every request (at most CONCURRENCY at once, one started every ``pace_s``)."""
    sem = asyncio.Semaphore(CONCURRENCY)
    results: dict[str, tuple[list[int], FinalResponse]] = {}

    async def one(req) -> None:
        async with sem:
            streamed, final = [], None
            async with contextlib.aclosing(client.stream(req)) as events:
                async for event in events:
                    if isinstance(event, TokenDelta):
                        streamed.extend(event.token_ids)
                    else:
                        final = event
            results[req.request_id] = (streamed, final)

    tasks = []
    for req in reqs:
        tasks.append(asyncio.create_task(one(req)))
        await asyncio.sleep(pace_s)
    await asyncio.gather(*tasks)
    return results


async def chaos(sup, stop: asyncio.Event, kills: list[str]) -> None:
    """Every KILL_EVERY_S: SIGKILL a random worker and start a replacement."""
    rng = random.Random(11)
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), KILL_EVERY_S)
        if stop.is_set():
            return
        victim = rng.choice(sorted(sup.children))
        child = sup.children.pop(victim)
        child.process.send_signal(signal.SIGKILL)
        await child.process.wait()
        kills.append(victim)
        await sup.start_worker()


async def test_no_request_is_lost_truncated_or_duplicated_while_workers_die(kafka):
    settings, _ = kafka
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "2"])
    async with running_deployment(settings, spec, workers=3, bridge=False, ready_timeout_s=120,
                                  worker_ttl_ms=KILLED_WORKER_TTL_MS) as sup:
        async with KvflowClient(sup.settings, sup.catalog, timeout_s=180) as client:
            reqs = requests(client)
            clean = await run_all(client, reqs, pace_s=0.0)
            assert all(f.error is None for _, f in clean.values())

            stop, kills = asyncio.Event(), []
            monkey = asyncio.create_task(chaos(sup, stop, kills))
            try:
                # ~5 requests/s: the faulty run lasts over 30 s, so several workers die under load.
                faulty = await run_all(client, reqs, pace_s=0.2)
            finally:
                stop.set()
                await monkey

    assert len(kills) >= 2, kills
    assert client.migrations >= 1
    lost = [rid for rid, (_, f) in faulty.items() if f is None or f.error is not None]
    assert not lost, [faulty[r][1] for r in lost[:3]]
    for rid, (streamed, final) in faulty.items():
        expected = clean[rid][1].token_ids
        assert final.token_ids == expected, rid  # not truncated, same output as without faults
        assert streamed == expected, rid  # the stream itself: no token lost or repeated
        assert final.usage.completion_tokens == len(expected)
