"""RouterCore: the router's decisions, pure and synchronous (no broker, no clock, no event loop)."""

from __future__ import annotations

import time

import pytest

from kvflow.router.core import (
    Arrival,
    Cancelled,
    Decision,
    KvDumpNeeded,
    RouterCore,
    WorkerExpired,
)
from kvflow.router.kv_policy import KvPolicyConfig
from kvflow.router.shedding import ShedConfig
from kvflow.schemas import (
    BlockStored,
    DecisionOutcome,
    InferenceRequest,
    KvEventBatch,
    ReplyTo,
    RequestAdmitted,
    RequestFinished,
    WorkerHeartbeat,
    WorkerRole,
)
from kvflow.schemas.block_hash import compute_block_hashes

MODEL = "m"
BS = 16
TOTAL_BLOCKS = 100


def hb(worker_id: str, ts_ms: int = 1_000, *, used: int = 0, active: int = 0, seq: int | None = None,
       started_ms: int = 1, role: WorkerRole = WorkerRole.aggregated, slot: int = 0, model: str = MODEL,
       ttl_ms: int = 5_000) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=role, model=model, engine="mocker", block_size=BS,
                           kv_total_blocks=TOTAL_BLOCKS, kv_used_blocks=used, active_requests=active,
                           queue_topic=f"q.{role.value}", queue_partition=slot, ts_ms=ts_ms, ttl_ms=ttl_ms,
                           started_ms=started_ms, lifecycle_seq=seq)


def arrival(rid: str, tokens: list[int] | None = None, *, model: str = MODEL, deadline_ms: int | None = None
            ) -> Arrival:
    tokens = tokens if tokens is not None else [hash(rid) % 1000 + i for i in range(64)]
    return Arrival(rid, model, len(tokens), token_ids=tokens, deadline_ms=deadline_ms, payload=rid)


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def stored(worker_id: str, event_id: int, tokens: list[int], ts_ms: int = 1_000) -> KvEventBatch:
    return KvEventBatch(worker_id=worker_id, event_id=event_id, block_size=BS, ts_ms=ts_ms,
                        events=[BlockStored(block_hashes=compute_block_hashes(tokens, BS))])


def core_with(*workers: str, policy: str = "kv", **kw) -> RouterCore:
    core = RouterCore(policy, router_id="r0", **kw)
    for slot, w in enumerate(workers):
        core.on_heartbeat(hb(w, slot=slot, seq=0))
    return core


def summary(d: Decision) -> tuple:
    """What a decision says, comparable across cores."""
    chosen = d.placement.decision if d.placement is not None else None
    return (d.outcome, d.arrival.request_id, d.decided_ms, d.reason, d.error,
            None if chosen is None else chosen.model_dump(exclude={"candidates"}),
            None if chosen is None else tuple(c.model_dump() for c in chosen.candidates))


def drive(core: RouterCore) -> list[tuple]:
    """One fixed input sequence: heartbeats, KV events, admissions, finishes, arrivals, ticks."""
    out = []
    shared = prompt(96)
    core.on_kv_batch(stored("w1", 0, shared))
    for i in range(12):
        now = 1_000 + 10 * i
        d = core.route(arrival(f"r{i}", shared + prompt(32, 1_000 * i) if i % 3 else prompt(80, 50_000 + i)), now)
        out.append(summary(d))
        if d.outcome is DecisionOutcome.routed:
            wid = d.target.worker_id
            core.on_request_admitted(RequestAdmitted(worker_id=wid, started_ms=1, seq=i, request_id=f"r{i}",
                                                     prompt_tokens=d.arrival.isl, prefill_tokens=d.arrival.isl,
                                                     ts_ms=now))
            if i % 2:
                core.on_request_finished(RequestFinished(worker_id=wid, started_ms=1, seq=100 + i,
                                                         request_id=f"r{i}", ts_ms=now + 5))
        out.extend(repr(e) for e in core.tick(now + 5))
    return out


@pytest.mark.parametrize("policy,temperature", [("kv", 0.0), ("kv", 0.7), ("approx", 0.0), ("round_robin", 0.0),
                                                ("random", 0.0), ("least_loaded", 0.0)])
def test_same_inputs_give_the_same_decisions(policy, temperature):
    def run() -> list[tuple]:
        return drive(core_with("w0", "w1", "w2", policy=policy, kv=KvPolicyConfig(temperature=temperature)))

    first, second = run(), run()
    assert first == second
    assert sum(1 for s in first if isinstance(s, tuple) and s[0] is DecisionOutcome.routed) == 12


def test_the_core_reads_no_clock(monkeypatch):
    def clock_read(*_a, **_k):
        raise AssertionError("RouterCore read the clock")

    core = core_with("w0", "w1", shed=ShedConfig(mode="queue", kv_threshold=0.5))
    for name in ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter"):
        monkeypatch.setattr(time, name, clock_read)
    drive(core)
    core.on_heartbeat(hb("w0", 2_000, used=90, seq=0))
    core.on_heartbeat(hb("w1", 2_000, used=90, seq=0))
    assert core.route(arrival("held"), 2_000).outcome is DecisionOutcome.queued
    core.on_request_cancelled("held")
    core.tick(60_000)


def test_repeated_prompt_sticks_to_the_worker_that_cached_it():
    core = core_with("w0", "w1", "w2", "w3")
    long = prompt(2_000)
    first = core.route(arrival("a", long), 1_000)
    wid = first.target.worker_id
    core.on_request_admitted(RequestAdmitted(worker_id=wid, started_ms=1, seq=0, request_id="a",
                                             prompt_tokens=2_000, prefill_tokens=2_000, ts_ms=1_000))
    core.on_kv_batch(stored(wid, 0, long))
    core.on_request_finished(RequestFinished(worker_id=wid, started_ms=1, seq=1, request_id="a", kv_event_id=1,
                                             ts_ms=1_200))
    assert core.kv_lagging() == []
    for i in range(9):  # each request ends before the next arrives
        d = core.route(arrival(f"again{i}", long), 1_300 + 100 * i)
        assert d.target.worker_id == wid
        assert d.placement.decision.overlap_blocks == 2_000 // BS
        core.on_request_admitted(RequestAdmitted(worker_id=wid, started_ms=1, seq=2 + 2 * i, request_id=f"again{i}",
                                                 prompt_tokens=2_000, prefill_tokens=0, ts_ms=1_300 + 100 * i))
        core.on_request_finished(RequestFinished(worker_id=wid, started_ms=1, seq=3 + 2 * i, request_id=f"again{i}",
                                                 kv_event_id=1, ts_ms=1_350 + 100 * i))
    assert core.table.workers[wid].load == 0


def test_no_worker_for_the_model_is_rejected():
    core = core_with("w0")
    d = core.route(arrival("x", model="other"), 1_000)
    assert d.outcome is DecisionOutcome.rejected and d.placement is None and d.target is None
    assert (d.error.status, d.error.code) == (503, "no_workers") and "other" in d.error.message
    assert core.counters["rejected"] == 1


def test_every_worker_busy_sheds_with_retry_after():
    core = core_with("w0", "w1")
    core.on_heartbeat(hb("w0", 1_001, used=99, slot=0, seq=0))
    d = core.route(arrival("a"), 1_002)
    assert d.outcome is DecisionOutcome.routed and d.target.worker_id == "w1"  # busy w0 is never a candidate
    core.on_heartbeat(hb("w1", 1_003, used=99, slot=1, seq=0))
    d = core.route(arrival("b"), 1_004)
    assert d.outcome is DecisionOutcome.shed and d.error.status == 503 and d.error.code == "overloaded"
    assert d.error.retry_after_s >= 1 and "busy" in d.reason
    assert core.counters["shed"] == 1 and core.queue is None


def test_queue_holds_releases_in_order_and_drops_at_the_deadline():
    core = core_with("w0", "w1", shed=ShedConfig(mode="queue", queue_capacity=3, kv_threshold=0.5))
    for w, slot in (("w0", 0), ("w1", 1)):
        core.on_heartbeat(hb(w, 1_001, used=80, slot=slot, seq=0))
    held = [core.route(arrival(f"q{i}", deadline_ms=10_000 if i == 2 else None), 1_002 + i) for i in range(4)]
    assert [d.outcome for d in held] == [DecisionOutcome.queued] * 3 + [DecisionOutcome.shed]
    assert "queue is full" in held[3].reason and len(core.queue) == 3
    assert core.tick(1_500) == []  # still busy: nothing released

    core.on_heartbeat(hb("w0", 2_000, used=0, slot=0, seq=0))
    core.on_heartbeat(hb("w1", 2_000, used=0, slot=1, seq=0))
    released = core.tick(2_000)
    # At most one per worker per tick (heartbeats lag the requests just released), in arrival order.
    assert [(e.outcome, e.arrival.request_id) for e in released] == [(DecisionOutcome.routed, "q0"),
                                                                     (DecisionOutcome.routed, "q1")]
    # While some are held, a new request queues behind them, even with free workers.
    assert core.route(arrival("late"), 2_001).outcome is DecisionOutcome.queued
    core.on_heartbeat(hb("w0", 9_000, used=0, slot=0, seq=0))
    core.on_heartbeat(hb("w1", 9_000, used=0, slot=1, seq=0))
    dropped = core.tick(10_000)
    assert dropped[0].outcome is DecisionOutcome.shed and dropped[0].arrival.request_id == "q2"
    assert (dropped[0].error.status, dropped[0].error.code) == (504, "deadline_exceeded")
    assert [e.arrival.request_id for e in dropped[1:]] == ["late"]
    assert core.counters["queue_timeouts"] == 1 and core.counters["released"] == 3


def test_a_finished_request_releases_one_held_request_between_ticks():
    core = core_with("w0", "w1", shed=ShedConfig(mode="queue", kv_threshold=0.5))
    for w, slot in (("w0", 0), ("w1", 1)):
        core.on_heartbeat(hb(w, 1_001, used=80, slot=slot, seq=0))
    assert all(core.route(arrival(f"q{i}"), 1_002 + i).outcome is DecisionOutcome.queued for i in range(3))
    assert core.release_freed(1_100) == []  # every worker still busy: the busy test holds them
    core.on_heartbeat(hb("w0", 1_200, used=0, slot=0, seq=0))
    core.on_heartbeat(hb("w1", 1_200, used=0, slot=1, seq=0))
    # Both free now, yet one finish record lets one request go (a tick would let two).
    released = core.release_freed(1_201)
    assert [(e.outcome, e.arrival.request_id) for e in released] == [(DecisionOutcome.routed, "q0")]
    assert [e.arrival.request_id for e in core.release_freed(1_202)] == ["q1"]
    assert len(core.queue) == 1 and core.counters["released"] == 2
    assert core_with("w0").release_freed(1_300) == []  # reject mode holds nothing


def test_a_cancelled_held_request_leaves_the_queue():
    core = core_with("w0", shed=ShedConfig(mode="queue", kv_threshold=0.5))
    core.on_heartbeat(hb("w0", 1_001, used=80, seq=0))
    core.route(arrival("a"), 1_002)
    core.route(arrival("b"), 1_003)
    assert core.on_request_cancelled("unknown") == []
    effects = core.on_request_cancelled("a")
    assert [type(e) for e in effects] == [Cancelled] and effects[0].arrival.payload == "a"
    assert [a.request_id for a in core.queue.pop_expired(10**12)] == [] and len(core.queue) == 1


def test_held_requests_of_a_model_nobody_serves_any_more_are_rejected_at_the_tick():
    core = core_with("w0", shed=ShedConfig(mode="queue", kv_threshold=0.5))
    core.on_heartbeat(hb("w0", 1_001, used=80, seq=0))
    assert core.route(arrival("a"), 1_002).outcome is DecisionOutcome.queued
    effects = core.tick(1_001 + 6_000)  # w0 silent past its TTL
    assert [type(e) for e in effects] == [WorkerExpired, Decision]
    assert effects[1].outcome is DecisionOutcome.rejected and effects[1].error.code == "no_workers"
    assert not core.queue


def test_a_cold_start_holds_requests_until_a_worker_registers():
    core = core_with(shed=ShedConfig(mode="queue", cold_start_hold_ms=60_000))  # no worker: a pool at zero
    held = [core.route(arrival(f"c{i}"), 1_000 + i) for i in range(3)]
    assert all(d.outcome is DecisionOutcome.queued and "held while one starts" in d.reason for d in held)
    assert core.counters["cold_held"] == 3 and core.held(2_000) == (3, 1_000)
    assert core.tick(5_000) == [] and len(core.queue) == 3  # still no worker: nothing rejected
    assert core.held(5_000) == (3, 4_000)
    core.on_heartbeat(hb("w0", 6_000, seq=0))  # the worker the planner started registers
    # an arrival routes at once: held cold-start requests are not a queue of busy workers
    assert core.route(arrival("new"), 6_000).outcome is DecisionOutcome.routed
    released = core.tick(6_000)  # all of them, as on arrival (not one per worker per tick), in order
    assert [(e.outcome, e.arrival.request_id) for e in released] == [(DecisionOutcome.routed, f"c{i}")
                                                                     for i in range(3)]
    assert core.held(6_000) == (0, 0) and not core.queue


def test_a_cold_hold_ends_with_503_and_does_not_block_served_models():
    core = core_with("w0", shed=ShedConfig(mode="queue", cold_start_hold_ms=10_000, kv_threshold=0.5))
    assert core.route(arrival("x", model="other"), 1_000).outcome is DecisionOutcome.queued  # no worker of it
    assert core.route(arrival("a"), 1_001).outcome is DecisionOutcome.routed  # not behind the held one
    core.on_heartbeat(hb("w0", 2_000, used=80, seq=0))
    core.route(arrival("b"), 2_001)  # w0 busy (80% > 50%): b waits in the queue behind x
    core.on_heartbeat(hb("w0", 3_000, seq=0))
    assert [(e.outcome, e.arrival.request_id) for e in core.tick(3_000)] == [(DecisionOutcome.routed, "b")]
    core.on_heartbeat(hb("w0", 11_000, seq=0))
    effects = core.tick(11_001)  # held 10.001 s > 10 s: no worker came
    assert [(e.outcome, e.arrival.request_id, e.error.code) for e in effects] == [
        (DecisionOutcome.rejected, "x", "no_workers")]
    assert not core.queue and core.held(11_001) == (0, 0)


def test_a_queue_full_of_cold_held_requests_sheds_when_the_workers_are_busy():
    core = core_with("w0", shed=ShedConfig(mode="queue", cold_start_hold_ms=60_000, queue_capacity=2,
                                           kv_threshold=0.5))
    core.on_heartbeat(hb("w0", 1_000, used=80, seq=0))  # w0 busy
    assert [core.route(arrival(f"x{i}", model="other"), 1_001).outcome for i in range(2)] == [
        DecisionOutcome.queued] * 2  # the queue is full of requests for a model nobody serves
    d = core.route(arrival("a"), 1_002)
    assert d.outcome is DecisionOutcome.shed and d.error.code == "overloaded" and len(core.queue) == 2


def test_a_cold_hold_needs_the_queue():
    with pytest.raises(ValueError, match="cold_start_hold_ms"):
        ShedConfig(cold_start_hold_ms=1_000)


def test_silent_workers_expire_before_a_decision():
    core = core_with("w0", "w1")
    core.on_heartbeat(hb("w1", 9_000, slot=1, seq=0))
    d = core.route(arrival("a"), 9_500)
    assert d.expired == ("w0",) and d.target.worker_id == "w1" and list(core.table.workers) == ["w1"]


def test_kv_gaps_ask_for_a_dump_until_it_comes_and_restarts_forget_blocks():
    core = core_with("w0", "w1")
    assert core.on_kv_batch(stored("w0", 0, prompt(64))) is None
    assert core.on_kv_batch(stored("w0", 5, prompt(64, 100))) == KvDumpNeeded("w0")
    assert core.tick(1_100) == [KvDumpNeeded("w0")]
    dump = stored("w0", 6, prompt(64)).model_copy(update={"dump": True})
    assert core.on_kv_batch(dump) is None and core.tick(1_200) == []
    index = core.table.kv_index
    assert index.find_matches(compute_block_hashes(prompt(64), BS)).prefix("w0") == 4
    core.on_heartbeat(hb("w0", 1_300, seq=0, started_ms=2))  # restarted under the same id
    assert index.find_matches(compute_block_hashes(prompt(64), BS)).prefix("w0") == 0
    assert (core.counters["kv_batches"], core.counters["kv_gaps"]) == (3, 1)


def test_arrival_of_a_request_shares_its_token_ids():
    request = InferenceRequest(request_id="r", model=MODEL, token_ids=prompt(40), reply_to=ReplyTo(topic="t",
                                                                                                    partition=0),
                               created_ms=5, deadline_ms=99, lora_name="ad")
    a = Arrival.of(request)
    assert a.token_ids is request.token_ids and a.payload is request
    assert (a.isl, a.created_ms, a.deadline_ms, a.lora_name) == (40, 5, 99, "ad")


def test_unknown_policy_is_refused():
    with pytest.raises(KeyError):
        RouterCore("nope")


def test_take_held_empties_the_queue_in_release_order():
    core = core_with(shed=ShedConfig(mode="queue", cold_start_hold_ms=60_000))
    for i in range(3):
        assert core.route(arrival(f"h{i}"), 1_000 + i).outcome is DecisionOutcome.queued
    taken = core.take_held()
    assert [a.request_id for a in taken] == ["h0", "h1", "h2"]
    assert not core.queue and core.held(2_000) == (0, 0) and core.counters["handed_back"] == 3
    assert core.tick(70_000) == []  # nothing left to drop at the hold's end
    assert core_with().take_held() == []  # reject mode holds nothing
