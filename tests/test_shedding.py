"""Load shedding: busy detection, reject/queue decisions, Retry-After, the bounded queue."""

from __future__ import annotations

import pytest

from kvflow.router.shedding import (
    BoundedRequestQueue,
    QueueFull,
    QueueOrder,
    ShedAction,
    ShedConfig,
    ShedMode,
    busy_reason,
    has_free_worker,
    is_busy,
    retry_after_s,
    shed,
)
from kvflow.router.table import WorkerView
from kvflow.schemas import WorkerHeartbeat, WorkerRole, WorkerStatus


def view(worker_id: str, used: int = 0, total: int = 100, prefill_tokens: int = 0) -> WorkerView:
    return WorkerView.from_heartbeat(WorkerHeartbeat(
        worker_id=worker_id, role=WorkerRole.aggregated, status=WorkerStatus.serving, model="m", engine="mocker",
        block_size=16, kv_total_blocks=total, kv_used_blocks=used, queue_topic="q", queue_partition=0,
        active_prefill_tokens=prefill_tokens, ts_ms=1))


def test_busy_by_kv_usage_and_by_queued_prefill():
    cfg = ShedConfig(kv_threshold=0.9, prefill_token_threshold=1000)
    assert busy_reason(view("a", used=91), cfg) == "kv"
    assert not is_busy(view("a", used=90), cfg)  # strictly above the threshold
    assert busy_reason(view("a", prefill_tokens=1001), cfg) == "prefill"
    assert not is_busy(view("a", prefill_tokens=1000), cfg)
    assert not is_busy(view("a", used=0, total=0), cfg)  # no KV figures reported
    assert not is_busy(view("a", prefill_tokens=10**9), ShedConfig())  # prefill check off by default
    assert is_busy(view("a", used=96), ShedConfig())  # default threshold 0.95


def test_routes_among_free_workers_only():
    cfg = ShedConfig(kv_threshold=0.9)
    d = shed([view("a", used=95), view("b", used=10), view("c", used=50)], cfg)
    assert d.action is ShedAction.route
    assert [w.worker_id for w in d.candidates] == ["b", "c"] and d.retry_after_s is None


def test_all_busy_rejects_with_retry_after():
    cfg = ShedConfig(kv_threshold=0.9, prefill_token_threshold=1000, prefill_tokens_per_s=1000.0)
    busy = [view("a", prefill_tokens=5_500), view("b", prefill_tokens=3_200)]
    d = shed(busy, cfg)
    assert d.action is ShedAction.reject and not d.candidates
    assert d.retry_after_s == 3  # b frees first: 2,200 excess tokens at 1,000 tokens/s, rounded up
    assert d.reason == "all workers busy"
    kv_busy = [view("a", used=99)]
    assert shed(kv_busy, cfg).retry_after_s == 2  # kv_drain_s
    assert shed([], cfg).action is ShedAction.reject and shed([], cfg).reason == "no worker"


def test_retry_after_is_clamped_and_grows_with_the_queue():
    cfg = ShedConfig(prefill_token_threshold=0, prefill_tokens_per_s=100.0, retry_after_max_s=30)
    assert retry_after_s([view("a", prefill_tokens=10**7)], cfg) == 30
    assert retry_after_s([view("a", prefill_tokens=1)], cfg) == 1
    two = [view("a", prefill_tokens=200), view("b", prefill_tokens=400)]
    assert retry_after_s(two, cfg) == 2
    assert retry_after_s(two, cfg, queued=4) == 6  # 2 s * (1 + 4 / 2)


def test_queue_mode():
    cfg = ShedConfig(kv_threshold=0.9, mode="queue", queue_capacity=2)
    busy = [view("a", used=95)]
    free = [view("a", used=10)]
    assert shed(busy, cfg, queued=0).action is ShedAction.queue
    assert shed(busy, cfg, queued=1).action is ShedAction.queue
    full = shed(busy, cfg, queued=2)
    assert full.action is ShedAction.reject and full.retry_after_s >= 1 and "queue is full" in full.reason
    assert shed(free, cfg, queued=1).action is ShedAction.queue  # keeps order behind queued requests
    assert shed(free, cfg, queued=0).action is ShedAction.route
    assert shed(free, cfg, queued=2).action is ShedAction.route  # full queue but a free worker: route
    assert has_free_worker(free, cfg) and not has_free_worker(busy, cfg)
    assert cfg.mode is ShedMode.queue and cfg.queue_order is QueueOrder.fcfs


def test_config_validation():
    for bad in ({"kv_threshold": 0.0}, {"kv_threshold": 1.5}, {"queue_capacity": 0},
                {"prefill_token_threshold": -1}, {"retry_after_min_s": 5, "retry_after_max_s": 2},
                {"prefill_tokens_per_s": 0}):
        with pytest.raises(ValueError):
            ShedConfig(**bad)
    with pytest.raises(ValueError):
        ShedConfig(mode="drop")


def test_fcfs_queue():
    q: BoundedRequestQueue[str] = BoundedRequestQueue(3)
    for name, isl in (("a", 500), ("b", 10), ("c", 100)):
        q.push(name, isl)
    assert len(q) == 3 and q.peek() == "a"
    with pytest.raises(QueueFull):
        q.push("d", 1)
    assert [q.pop(), q.pop(), q.pop()] == ["a", "b", "c"]
    assert not q
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(IndexError):
        q.peek()


def test_sjf_queue_shortest_first_ties_in_arrival_order():
    q: BoundedRequestQueue[str] = BoundedRequestQueue(10, "sjf")
    for name, isl in (("a", 500), ("b", 10), ("c", 100), ("d", 10), ("e", 7)):
        q.push(name, isl)
    assert [q.pop() for _ in range(5)] == ["e", "b", "d", "c", "a"]
    with pytest.raises(ValueError):
        BoundedRequestQueue(0)


def test_expired_requests_leave_the_queue():
    q: BoundedRequestQueue[str] = BoundedRequestQueue(10, QueueOrder.sjf)
    q.push("late", 5, deadline_ms=100)
    q.push("ok", 1, deadline_ms=1_000)
    q.push("never", 2)
    q.push("late2", 3, deadline_ms=50)
    assert q.pop_expired(100) == ["late2", "late"]
    assert q.pop_expired(100) == []
    assert len(q) == 2 and [q.pop(), q.pop()] == ["ok", "never"]
