"""An idle worker's heartbeat loop parks between idle beats and work wakes it
(kvflow.workers.worker, kvflow.workers.heartbeat_clock), on the real broker."""

from __future__ import annotations

import asyncio

from deployment import first_record, in_process_cluster

from kvflow.schemas import SamplingParams, WorkerHeartbeat, decode
from kvflow.workers.engines.mocker_core import MockerConfig
from kvflow.workers.worker import Worker

MODEL = "mock-idle"
INTERVAL_MS = 200
IDLE_MS = 3_600_000
"""An hour: a loop that slept to its next idle beat without being woken would
show nothing of the request below within the test's deadline."""


async def heartbeat_showing_work(settings, catalog, worker_id: str, timeout_s: float) -> WorkerHeartbeat:
    """The first heartbeat of ``worker_id`` whose ``lifecycle_seq`` is past 0 (it has taken a request).

    Raises:
        AssertionError: none within ``timeout_s``.
    """
    def showing_work(value: bytes) -> WorkerHeartbeat | None:
        hb = decode(WorkerHeartbeat, value)
        return hb if hb.worker_id == worker_id and hb.lifecycle_seq > 0 else None

    hb = await first_record(settings, catalog.workers.name, catalog.workers.partitions, showing_work, timeout_s)
    if hb is None:
        raise AssertionError(f"no heartbeat of {worker_id} showed its request within {timeout_s} s")
    return hb


async def test_an_idle_worker_parks_between_beats_and_a_request_wakes_it(kafka, waiter, monkeypatch):
    settings, catalog = kafka
    settings = settings.model_copy(update={"heartbeat_interval_ms": INTERVAL_MS, "heartbeat_idle_ms": IDLE_MS})
    mocker = MockerConfig(speedup_ratio=1.0, block_size=16, num_kv_blocks=1024)
    snapshots: list[int] = []
    record = Worker._heartbeat_record

    def counted(self: Worker) -> WorkerHeartbeat:
        snapshots.append(1)
        return record(self)

    monkeypatch.setattr(Worker, "_heartbeat_record", counted)  # every tick the loop wakes for builds one
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker,
                                  workers=1) as (_, _workers, client):
        # The start-up beat, the first tick (a beat: nothing was sent from the loop yet), then
        # the first tick that finds nothing new and parks.
        await waiter(lambda: len(snapshots) >= 3, timeout_s=60)
        parked_at = len(snapshots)
        await asyncio.sleep(20 * INTERVAL_MS / 1000)  # a window of 20 ticks
        assert len(snapshots) - parked_at <= 2, "an idle, unchanged worker woke on every tick"

        request = client.new_request(MODEL, prompt="wake up", sampling=SamplingParams(max_tokens=4))
        final = await client.complete(request)
        assert final.worker_id == "w0" and final.usage.completion_tokens == 4
        hb = await heartbeat_showing_work(settings, catalog, "w0", timeout_s=30)
        assert hb.lifecycle_seq >= 1
