"""FairRequestQueue (priority class → tenant fair share → EDF) and its use by RouterCore; session affinity."""

from __future__ import annotations

import pytest

from kvflow.router.affinity import SessionTable, prefer_session_worker
from kvflow.router.core import Arrival, RouterCore
from kvflow.router.fair_queue import FairRequestQueue
from kvflow.router.shedding import QueueFull, ShedConfig
from kvflow.schemas import CandidateCost, DecisionOutcome, RoutingDecision, WorkerHeartbeat, WorkerRole

MODEL = "m"


def drain(q: FairRequestQueue) -> list:
    out = []
    while q:
        out.append(q.pop())
    return out


def test_higher_class_first_then_earliest_deadline():
    q = FairRequestQueue(10)
    q.push("low-early", deadline_ms=100, priority=0)
    q.push("high-none", deadline_ms=None, priority=5)
    q.push("high-late", deadline_ms=900, priority=5)
    q.push("high-early", deadline_ms=200, priority=5)
    q.push("low-late", deadline_ms=50_000, priority=0)
    assert q.peek() == "high-early" and q.peek_priority() == 5
    assert drain(q) == ["high-early", "high-late", "high-none", "low-early", "low-late"]


def test_tenants_share_releases_whatever_their_backlog():
    q = FairRequestQueue(100)
    for i in range(30):
        q.push(f"big{i}", tenant="big")
    for i in range(3):
        q.push(f"small{i}", tenant="small")
    first = drain(q)[:6]
    assert sorted(first) == ["big0", "big1", "big2", "small0", "small1", "small2"]


def test_an_idle_tenant_earns_no_credit():
    q = FairRequestQueue(100)
    for i in range(10):
        q.push(f"a{i}", tenant="a")
    for _ in range(8):
        q.pop()
    # b arrives late: it starts at the virtual clock (the start of the last release), not at 0, so
    # it gets one release of catch-up, then they alternate.
    for i in range(4):
        q.push(f"b{i}", tenant="b")
    assert drain(q) == ["b0", "a8", "b1", "a9", "b2", "b3"]


def test_full_queue_sheds_the_lowest_class_from_the_heaviest_tenant():
    q = FairRequestQueue(4)
    q.push("lo-a1", deadline_ms=100, priority=0, tenant="a")
    q.push("lo-a2", deadline_ms=300, priority=0, tenant="a")
    q.push("lo-b1", deadline_ms=200, priority=0, tenant="b")
    q.push("hi", priority=1, tenant="b")
    with pytest.raises(QueueFull):
        q.push("x", priority=9)
    # a higher class displaces a's latest-deadline low request
    assert q.displace("hi2", priority=1, tenant="c") == "lo-a2"
    # same class, a tenant holding none vs one holding one: no gain, the new one is shed
    with pytest.raises(QueueFull):
        q.displace("lo-c", priority=0, tenant="c")
    assert len(q) == 4 and drain(q)[:2] == ["hi", "hi2"]


def test_same_class_displaces_only_a_heavier_tenant():
    q = FairRequestQueue(3)
    for i in range(3):
        q.push(f"a{i}", deadline_ms=10 * i, tenant="a")
    assert q.displace("b0", tenant="b") == "a2"
    with pytest.raises(QueueFull):  # a now holds 2, b 1: swapping again gains nothing
        q.displace("b1", tenant="b")
    assert q.held_by_tenant() == {"a": 2, "b": 1}


def test_expired_and_removed_leave_consistent_state():
    q = FairRequestQueue(10)
    q.push("x", deadline_ms=10, priority=1, tenant="a")
    q.push("y", deadline_ms=20, priority=0, tenant="b")
    q.push("z", deadline_ms=None, priority=0, tenant="b")
    assert q.pop_expired(15) == ["x"]
    assert q.remove(lambda item: item == "z") == ["z"]
    assert len(q) == 1 and q.peek_priority() == 0 and drain(q) == ["y"]
    with pytest.raises(IndexError):
        q.peek()


# ---- RouterCore in priority order -----------------------------------------------------


def hb(worker_id: str, ts_ms: int, *, used: int = 0, slot: int = 0) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=WorkerRole.aggregated, model=MODEL, engine="mocker",
                           block_size=16, kv_total_blocks=100, kv_used_blocks=used, queue_topic="q",
                           queue_partition=slot, ts_ms=ts_ms, ttl_ms=60_000, started_ms=1, lifecycle_seq=0)


def arr(rid: str, *, priority: int = 0, tenant: str = "", deadline_ms: int | None = None,
        session_id: str | None = None) -> Arrival:
    return Arrival(rid, MODEL, 64, token_ids=list(range(64)), deadline_ms=deadline_ms, payload=rid,
                   priority=priority, tenant=tenant, session_id=session_id)


def busy_core(capacity: int = 3, *, workers: int = 1) -> RouterCore:
    core = RouterCore("least_loaded", shed=ShedConfig(mode="queue", queue_capacity=capacity, kv_threshold=0.5,
                                                       queue_order="priority"))
    for i in range(workers):
        core.on_heartbeat(hb(f"w{i}", 1_000, used=80, slot=i))
    return core


def test_core_releases_high_class_first_and_sheds_low_class_at_a_full_queue():
    core = busy_core(3)
    assert [core.route(arr(f"lo{i}", deadline_ms=50_000 + i), 1_001).outcome for i in range(3)] == \
        [DecisionOutcome.queued] * 3
    d = core.route(arr("hi", priority=1), 1_002)
    assert d.outcome is DecisionOutcome.queued
    assert [(x.outcome, x.arrival.request_id, x.error.status) for x in d.displaced] == \
        [(DecisionOutcome.shed, "lo2", 503)]
    assert core.route(arr("lo3"), 1_003).outcome is DecisionOutcome.shed  # ranks no higher: shed itself
    assert core.counters["displaced"] == 1 and core.counters["shed"] == 2
    core.on_heartbeat(hb("w0", 2_000))
    released = core.tick(2_000)
    assert [e.arrival.request_id for e in released] == ["hi"]


def test_a_higher_class_skips_a_queue_of_lower_ones_when_a_worker_is_free():
    core = busy_core(8)
    core.route(arr("lo0"), 1_001)
    core.on_heartbeat(hb("w0", 1_500))  # free again, the tick has not run yet
    assert core.route(arr("lo1"), 1_501).outcome is DecisionOutcome.queued  # keeps its place in line
    d = core.route(arr("hi", priority=2), 1_502)
    assert d.outcome is DecisionOutcome.routed and core.counters["jumped"] == 1


def test_core_shares_releases_between_tenants():
    core = busy_core(100, workers=2)
    for i in range(20):
        core.route(arr(f"a{i}", tenant="a"), 1_001 + i)
    for i in range(2):
        core.route(arr(f"b{i}", tenant="b"), 1_100 + i)
    order = []
    for t in range(4):
        core.on_heartbeat(hb("w0", 2_000 + t * 1000, slot=0))
        core.on_heartbeat(hb("w1", 2_000 + t * 1000, slot=1))
        order += [e.arrival.request_id for e in core.tick(2_000 + t * 1000)]
    # Two releases per tick (one per worker); b's two requests go out among the first four.
    assert order[:6] == ["a0", "b0", "a1", "b1", "a2", "a3"]


# ---- session affinity -----------------------------------------------------------------


def decision(worker: str, costs: dict[str, float]) -> RoutingDecision:
    return RoutingDecision(worker_id=worker, policy="kv", cost=costs[worker],
                           candidates=tuple(CandidateCost(worker_id=w, cost=c) for w, c in costs.items()))


def test_session_worker_kept_within_the_margin_only():
    d = decision("w0", {"w0": 10.0, "w1": 12.0, "w2": 13.0})
    moved = prefer_session_worker(d, "w1", 0.25, {"w0", "w1", "w2"})
    assert moved.worker_id == "w1" and moved.cost == 12.0
    assert prefer_session_worker(d, "w2", 0.25, {"w0", "w1", "w2"}) is None  # 13 > 10 + 2.5
    assert prefer_session_worker(d, "w1", 0.25, {"w0", "w2"}) is None  # busy: not allowed
    idle = decision("w0", {"w0": 0.0, "w1": 0.2})
    assert prefer_session_worker(idle, "w1", 0.25, {"w0", "w1"}).worker_id == "w1"


def test_session_table_is_lru_bounded_and_forgets_lost_workers():
    t = SessionTable(2)
    t.note("s1", "w0")
    t.note("s2", "w1")
    t.get("s1")
    t.note("s3", "w0")
    assert t.get("s1") is None and len(t) == 2  # least recently noted went first
    t.forget_worker("w0")
    assert t.get("s3") is None and t.get("s2") == "w1"


def test_core_keeps_a_session_on_its_worker_while_the_cost_is_close():
    core = RouterCore("least_loaded")
    for i in range(2):
        core.on_heartbeat(hb(f"w{i}", 1_000, slot=i))
    first = core.route(arr("t1", session_id="chat"), 1_001)
    assert first.outcome is DecisionOutcome.routed and not first.session_hit
    home = first.target.worker_id
    # The next turn: home holds one request, the other worker none: 1 > 0 + 0.25 · max(0, 1), so it moves.
    second = core.route(arr("t2", session_id="chat"), 1_002)
    assert second.target.worker_id != home and not second.session_hit
    # With a wider margin the session stays home.
    core2 = RouterCore("least_loaded", session_margin=1.0)
    for i in range(2):
        core2.on_heartbeat(hb(f"w{i}", 1_000, slot=i))
    home = core2.route(arr("t1", session_id="chat"), 1_001).target.worker_id
    second = core2.route(arr("t2", session_id="chat"), 1_002)
    assert second.target.worker_id == home and second.session_hit and core2.counters["session_hits"] == 1
    assert core2.route(arr("t3"), 1_003).target.worker_id != home  # no session: the policy's choice


def test_reserve_keeps_headroom_for_the_top_classes():
    cfg = ShedConfig(mode="queue", queue_order="priority", kv_threshold=0.8, prefill_token_threshold=1000,
                     reserve_fraction=0.25)
    low, high = cfg.for_priority(0), cfg.for_priority(1)
    assert high is cfg and low.kv_threshold == pytest.approx(0.6) and low.prefill_token_threshold == 750
    assert ShedConfig().for_priority(-5) is not None and ShedConfig().for_priority(-5).kv_threshold == 0.95
    with pytest.raises(ValueError):
        ShedConfig(reserve_fraction=1.0)
    core = RouterCore("least_loaded", shed=cfg)
    core.on_heartbeat(hb("w0", 1_000, used=70))  # 70% KV: busy for class 0, free for class 1
    assert core.route(arr("lo"), 1_001).outcome is DecisionOutcome.queued
    assert core.route(arr("hi", priority=1), 1_002).outcome is DecisionOutcome.routed


def test_replay_under_overload_serves_the_high_class_and_sheds_the_low_one():
    from kvflow.replay.simulator import SimConfig, simulate
    from kvflow.replay.traces import TraceRequest
    from kvflow.workers.engines.mocker_core import MockerConfig

    # 5 requests/s at one worker whose KV holds about ten: one in ten of class 1.
    trace = [TraceRequest(request_id=f"r{i}", index=i, arrival_ms=200.0 * i, isl=1024, osl=256,
                          priority=1 if i % 10 == 0 else 0, timeout_ms=20_000.0) for i in range(200)]
    high_ids = {t.request_id for t in trace if t.priority == 1}

    def run(order: str, reserve: float) -> tuple[list, list]:
        shed = ShedConfig(mode="queue", queue_order=order, queue_capacity=16, kv_threshold=0.8,
                          prefill_token_threshold=4096, reserve_fraction=reserve)
        res = simulate(trace, SimConfig(workers=1, policy="least_loaded", shed=shed,
                                        mocker=MockerConfig(num_kv_blocks=300, max_num_seqs=64)))
        return ([r for r in res.records if r.request_id in high_ids],
                [r for r in res.records if r.request_id not in high_ids])

    high, low = run("fcfs", 0.0)
    assert sum(r.ok for r in high) < len(high)  # arrival order: the high class is shed like the rest
    high, low = run("priority", 0.25)
    assert all(r.ok for r in high) and max(r.first_token_ms - r.arrival_ms for r in high) < 1_000
    assert sum(1 for r in low if r.error and r.error.startswith("shed")) > len(low) // 2
