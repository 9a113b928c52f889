"""The quiet-wait cap of heartbeat readers (:func:`kvflow.streams.workers.liveness_wait`)."""

from __future__ import annotations

from kvflow.schemas import WorkerHeartbeat, WorkerStatus
from kvflow.settings import Settings
from kvflow.streams.workers import Workers, liveness_idle_wait_ms, liveness_wait

SETTINGS = Settings(bootstrap_servers="x:1", heartbeat_interval_ms=1000, worker_ttl_ms=5000, fetch_idle_wait_ms=5000)


def beat(worker_id: str, ts_ms: int, ttl_ms: int, status: WorkerStatus = WorkerStatus.serving) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, model="m", engine="mocker", status=status, block_size=16,
                           kv_total_blocks=100, kv_used_blocks=0, queue_topic="q", queue_partition=0,
                           ts_ms=ts_ms, ttl_ms=ttl_ms)


def test_with_no_worker_the_reader_parks_for_the_idle_wait():
    assert liveness_wait(SETTINGS, Workers(), clock=lambda: 0)() == 5000


def test_the_cap_returns_the_fetch_a_bound_before_the_first_expiry():
    workers, now = Workers(), [100_000]
    cap = liveness_wait(SETTINGS, workers, clock=lambda: now[0])
    bound = liveness_idle_wait_ms(SETTINGS)
    assert bound == 2000
    workers.apply(beat("idle", 100_000, 9000))  # an idle beat: expires at 109,000
    assert cap() == 5000  # 109,000 - 100,000 - 2,000 = 7,000, above the idle wait
    now[0] = 104_000
    assert cap() == 3000  # returns at 107,000, a bound before the expiry
    workers.apply(beat("busy", 104_500, 5000))  # expires at 109,500; "idle" still first
    now[0] = 106_500
    assert cap() == bound  # 109,000 - 106,500 - 2,000 = 500: never below the bound
    workers.apply(beat("idle", 105_000, 9000))  # now 114,000
    workers.apply(beat("busy", 106_000, 5000))  # now 111,000: the first
    assert cap() == 111_000 - 106_500 - bound


def test_an_overdue_worker_keeps_the_reader_at_the_bound():
    workers = Workers()
    workers.apply(beat("late", 0, 5000))
    assert liveness_wait(SETTINGS, workers, clock=lambda: 60_000)() == liveness_idle_wait_ms(SETTINGS)


def test_a_stopped_worker_no_longer_bounds_the_wait():
    workers = Workers()
    workers.apply(beat("w", 0, 5000))
    workers.apply(beat("w", 1, 5000, WorkerStatus.stopped))
    assert workers.next_expiry_ms() is None
    assert liveness_wait(SETTINGS, workers, clock=lambda: 1)() == 5000
