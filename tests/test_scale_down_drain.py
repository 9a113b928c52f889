"""Scale-down under load loses no request: a scaling command drains one of two worker
processes while requests stream through the real broker, router and workers."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.planner.connectors import ConnectorService
from kvflow.planner.connectors.local import LocalConnector
from kvflow.planner.loop import publish_command
from kvflow.schemas import SamplingParams, ScalingCommand, WorkerRole, now_ms
from kvflow.streams.client import KvflowClient
from kvflow.streams.kafka import make_producer
from kvflow.supervisor import Supervisor, WorkerSpec

MODEL = "mock-model"
AGG = WorkerRole.aggregated
NUM_REQUESTS = 80
GAP_S = 0.04  # 25 requests/s
MAX_TOKENS = 40  # about 0.3 s of mocker decode at speedup 1: many requests are in flight at any time


@pytest.fixture
async def two_workers(kafka, monkeypatch):
    settings, _ = kafka
    monkeypatch.setenv("KVFLOW_HEARTBEAT_INTERVAL_MS", str(settings.heartbeat_interval_ms))
    monkeypatch.setenv("KVFLOW_WORKER_TTL_MS", str(settings.worker_ttl_ms))
    sup = Supervisor(settings, WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio=1"]),
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
        await asyncio.sleep(i * GAP_S)
        req = client.new_request(MODEL, prompt=f"request {i} " + "x" * (i % 7) * 40,
                                 sampling=SamplingParams(max_tokens=MAX_TOKENS))
        return await client.complete(req)

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(NUM_REQUESTS)]
        await asyncio.sleep(NUM_REQUESTS * GAP_S / 2)
        drain_ms = now_ms()
        await publish_command(producer, catalog, ScalingCommand(
            decision_id="scale-down", pool=AGG, target_replicas=1, current_replicas=2, ts_ms=drain_ms))
        finals = await asyncio.gather(*tasks)
        await waiter(lambda: len(service.applied) == 1, timeout_s=30)
    finally:
        await producer.stop()
        await client.stop()
        await service.stop()

    assert [(a.replicas, a.error) for a in service.applied] == [(1, None)]
    assert victim.returncode == 0 and list(sup.children) != [victim_id] and sup.replicas(AGG) == 1
    errors = [(f.request_id, f.error) for f in finals if f.error is not None]
    assert errors == []
    assert all(f.usage.completion_tokens == MAX_TOKENS for f in finals)
    # The drain had work to save: requests in flight on the victim when the command was published ...
    on_victim = [f for f in finals if f.worker_id == victim_id]
    assert any(f.timings.started_ms < drain_ms < f.timings.finished_ms for f in on_victim)
    # ... and everything sent after the victim's drain completed went to the survivor.
    assert all(f.worker_id != victim_id for f in finals if f.timings.queued_ms > service.applied[0].finished_ms)
    assert any(f.worker_id != victim_id and f.timings.queued_ms > drain_ms for f in finals)
