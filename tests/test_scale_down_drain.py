"""Scale-down under load loses no request: a scaling command drains one of two worker
processes while requests stream through the real broker, router and workers."""

from __future__ import annotations

import asyncio

import pytest
from deployment import steady

from kvflow.planner.connectors import ConnectorService
from kvflow.planner.connectors.local import LocalConnector
from kvflow.planner.loop import publish_command
from kvflow.schemas import SamplingParams, ScalingCommand, WorkerRole, now_ms
from kvflow.streams.client import KvflowClient
from kvflow.streams.kafka import make_producer
from kvflow.supervisor import Supervisor, WorkerSpec

MODEL = "mock-model"
AGG = WorkerRole.aggregated
MAX_BEFORE = 80  # requests sent at most before the scale-down (sending pauses there until it is published)
AFTER = 40  # requests sent after it
GAP_S = 0.04  # 25 requests/s
MAX_TOKENS = 40  # about 0.3 s of mocker decode at speedup 1: many requests are in flight at any time


@pytest.fixture
async def two_workers(kafka):
    settings, _ = kafka
    # steady(): no worker dies here; on a loaded machine a heartbeat late by the fixture's 3 s
    # TTL read as two lost workers (both answered worker_lost).
    sup = Supervisor(steady(settings), WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio=1"]),
                     bridge=False)
    await sup.start()
    try:
        await sup.scale(AGG, 2)
        await sup.wait_workers_ready(2, timeout_s=30)
        yield sup
    finally:
        await sup.stop()


async def test_scale_down_under_load_loses_no_request(kafka, two_workers, waiter):
    settings, catalog = kafka
    sup = two_workers
    victim_id = list(sup.children)[-1]  # the supervisor drains the newest worker
    victim = sup.children[victim_id].process
    service = ConnectorService(settings, catalog, LocalConnector(sup))
    await service.start()
    client = KvflowClient(settings, catalog, timeout_s=60)
    await client.start()
    producer = make_producer(settings)
    await producer.start()

    async def one(i: int):
        req = client.new_request(MODEL, prompt=f"request {i} " + "x" * (i % 7) * 40,
                                 sampling=SamplingParams(max_tokens=MAX_TOKENS))
        return await client.complete(req)

    tasks: list[asyncio.Task] = []
    drained = asyncio.Event()

    async def send() -> None:
        """One request per GAP_S until AFTER went out after the scale-down."""
        after = 0
        while after < AFTER:
            if len(tasks) >= MAX_BEFORE:
                await drained.wait()
            tasks.append(asyncio.create_task(one(len(tasks))))
            after += drained.is_set()
            await asyncio.sleep(GAP_S)

    def victim_busy() -> bool:  # requests the victim admitted and has not finished, as the router sees them
        view = sup.router.table.inflight.workers.get(victim_id)
        return view is not None and len(view.admitted) >= 2

    sender = asyncio.create_task(send())
    try:
        # Scale down while the victim holds requests (a loaded machine can take seconds to get there).
        await waiter(victim_busy, timeout_s=120)
        drain_ms = now_ms()
        await publish_command(producer, catalog, ScalingCommand(
            decision_id="scale-down", pool=AGG, target_replicas=1, current_replicas=2, ts_ms=drain_ms))
        drained.set()
        await sender
        finals = await asyncio.gather(*tasks)
        await waiter(lambda: len(service.applied) == 1, timeout_s=30)
    finally:
        sender.cancel()
        for task in tasks:
            task.cancel()
        await producer.stop()
        await client.stop()
        await service.stop()

    assert [(a.replicas, a.error) for a in service.applied] == [(1, None)]
    assert victim.returncode == 0 and list(sup.children) != [victim_id] and sup.replicas(AGG) == 1
    errors = [(f.request_id, f.error) for f in finals if f.error is not None]
    assert errors == []
    assert all(f.usage.completion_tokens == MAX_TOKENS for f in finals)
    # The drain had work to save: requests the victim held (queued or running) when the command
    # was published ... (on a loaded host the one it held may not have started by then)
    on_victim = [f for f in finals if f.worker_id == victim_id]
    assert any(f.timings.queued_ms < drain_ms < f.timings.finished_ms for f in on_victim)
    # ... and everything sent after the victim's drain completed went to the survivor.
    assert all(f.worker_id != victim_id for f in finals if f.timings.queued_ms > service.applied[0].finished_ms)
    assert any(f.worker_id != victim_id and f.timings.queued_ms > drain_ms for f in finals)
