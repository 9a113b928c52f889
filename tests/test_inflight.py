"""Exact in-flight load (kvflow.router.inflight): counting, finish, cancel,
heartbeat reconciliation, expiry, replicas that agree, and its effect on routing."""

from __future__ import annotations

import itertools

import pytest

from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.router.index import KvIndex
from kvflow.router.inflight import (
    FINISHED_REMEMBERED,
    ORPHAN_TTL_MS,
    apply_inflight_record,
    expire_inflight,
    kv_lagging,
    note_routed_request,
    stall_exposure,
    waive_kv,
)
from kvflow.router.policies import RouteRequest, select_worker
from kvflow.router.table import RoutingTable, apply_heartbeat, expire_workers
from kvflow.schemas import (
    BlockStored,
    InflightRecord,
    KvEventBatch,
    RequestAdmitted,
    RequestFinished,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
    decode,
    encode,
)

BS = 16
MODEL = "m"
START = 100  # started_ms of the workers' first incarnation


def hb(worker_id: str, *, seq: int | None = 0, held: int | None = 0, active: int = 0, waiting: int = 0,
       prefill: int = 0, ts_ms: int = 1_000, started_ms: int = START, ttl_ms: int = 5_000,
       status: WorkerStatus = WorkerStatus.serving) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=WorkerRole.aggregated, status=status, model=MODEL,
                           engine="mocker", block_size=BS, kv_total_blocks=1000, queue_topic="q", queue_partition=0,
                           active_requests=active, waiting_requests=waiting, active_prefill_tokens=prefill,
                           ts_ms=ts_ms, ttl_ms=ttl_ms, started_ms=started_ms, lifecycle_seq=seq,
                           inflight_requests=held)


def admitted(worker_id: str, rid: str, seq: int, *, prompt: int = 320, prefill: int = 320, started_ms: int = START,
             ts_ms: int = 1_000, max_tokens: int = 0) -> RequestAdmitted:
    return RequestAdmitted(worker_id=worker_id, started_ms=started_ms, seq=seq, request_id=rid,
                           prompt_tokens=prompt, prefill_tokens=prefill, max_tokens=max_tokens, ts_ms=ts_ms)


def finished(worker_id: str, rid: str, seq: int, *, cancelled: bool = False, kv_event_id: int = 0,
             started_ms: int = START, ts_ms: int = 1_000) -> RequestFinished:
    return RequestFinished(worker_id=worker_id, started_ms=started_ms, seq=seq, request_id=rid,
                           cancelled=cancelled, kv_event_id=kv_event_id, ts_ms=ts_ms)


def table_of(*workers: str, **kw) -> RoutingTable:
    table = RoutingTable()
    for w in workers:
        apply_heartbeat(table, hb(w, **kw))
    return table


def figures(table: RoutingTable, worker_id: str) -> tuple[int, int, int, int, int | None]:
    w = table.workers[worker_id]
    return (w.active_requests, w.waiting_requests, w.active_prefill_tokens, w.routed_since_heartbeat,
            w.routed_prefill_tokens)


def route(table: RoutingTable, worker_id: str, rid: str, *, prompt: int = 320, prefill: int = 320,
          now_ms: int = 1_000) -> None:
    note_routed_request(table, worker_id, rid, prompt_tokens=prompt, prefill_tokens=prefill, now_ms=now_ms)


IDLE = (0, 0, 0, 0, 0)


# ---- records ------------------------------------------------------------------------------------

def test_records_round_trip_through_the_union():
    for record in (admitted("w0", "r1", 3), finished("w0", "r1", 4, cancelled=True, kv_event_id=9)):
        assert decode(InflightRecord, encode(record)) == record
    plain = decode(WorkerHeartbeat, encode(hb("w0", seq=None, held=None)))
    assert plain.lifecycle_seq is None and plain.inflight_requests is None


# ---- counting -----------------------------------------------------------------------------------

def test_routed_requests_count_with_their_own_prefill_work():
    table = table_of("w0")
    assert figures(table, "w0") == IDLE
    route(table, "w0", "a", prefill=320)
    route(table, "w0", "b", prefill=64)
    assert figures(table, "w0") == (0, 0, 0, 2, 384)
    route(table, "w0", "a")  # the same request again (a second replica's decision, a retry): counted once
    assert figures(table, "w0")[3] == 2


def test_admission_takes_over_the_routed_entry_without_counting_twice():
    table = table_of("w0")
    route(table, "w0", "a", prefill=320)
    apply_inflight_record(table, admitted("w0", "a", 0, prefill=300))
    assert figures(table, "w0") == (0, 0, 0, 1, 300)  # the record's figures win: every replica has them
    apply_inflight_record(table, admitted("w0", "a", 0))  # a duplicate record
    assert figures(table, "w0")[3] == 1


def test_requests_routed_by_another_replica_count_once_admitted():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "other-replica", 0, prefill=128))
    assert figures(table, "w0") == (0, 0, 0, 1, 128)


def test_workers_without_inflight_records_count_the_old_way():
    table = table_of("w0", seq=None, held=None)
    route(table, "w0", "a")
    route(table, "w0", "b")
    w = table.workers["w0"]
    assert (w.routed_since_heartbeat, w.routed_prefill_tokens) == (2, None)
    apply_heartbeat(table, hb("w0", seq=None, held=None, ts_ms=2_000, active=2))
    assert figures(table, "w0") == (2, 0, 0, 0, None)


def test_unknown_worker_is_ignored():
    table = table_of("w0")
    route(table, "nope", "a")
    assert "nope" not in table.workers and "nope" not in table.inflight.workers


# ---- finish and cancel --------------------------------------------------------------------------

def test_stall_exposure_sums_each_held_request_by_its_output_cap():
    table = table_of("w0")
    assert table.workers["w0"].stall_exposure == 0
    note_routed_request(table, "w0", "r1", prompt_tokens=320, prefill_tokens=320, now_ms=1_000, max_tokens=5)
    assert table.workers["w0"].stall_exposure == pytest.approx(1 / 4)
    apply_inflight_record(table, admitted("w0", "r1", 0, max_tokens=5))  # takes the routed entry over
    apply_inflight_record(table, admitted("w0", "r2", 1, max_tokens=101))  # routed by another replica
    apply_inflight_record(table, admitted("w0", "r3", 2, max_tokens=1))  # one token: no gap to stretch
    apply_inflight_record(table, admitted("w0", "r4", 3))  # a remote prefill (decodes nothing) or unknown
    assert table.workers["w0"].stall_exposure == pytest.approx(1 / 4 + 1 / 100)
    apply_inflight_record(table, finished("w0", "r1", 4))
    assert table.workers["w0"].stall_exposure == pytest.approx(1 / 100)
    apply_heartbeat(table, hb("w0", seq=5, held=3, active=2, waiting=1, ts_ms=2_000))  # covering them changes nothing
    assert table.workers["w0"].stall_exposure == pytest.approx(1 / 100)
    for seq, rid in enumerate(("r2", "r3", "r4"), start=5):
        apply_inflight_record(table, finished("w0", rid, seq))
    assert table.workers["w0"].stall_exposure == 0  # exact: summed in integer parts
    assert stall_exposure(94) == pytest.approx(1 / 93) and stall_exposure(0) == stall_exposure(1) == 0


def test_finish_frees_the_worker_at_once():
    table = table_of("w0")
    route(table, "w0", "a")
    apply_inflight_record(table, admitted("w0", "a", 0))
    apply_inflight_record(table, finished("w0", "a", 1))
    assert figures(table, "w0") == IDLE
    assert table.inflight.workers["w0"].held() == 0


def test_finish_of_a_request_in_the_heartbeat_figures_clears_them():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "a", 0, prompt=2000))
    apply_inflight_record(table, admitted("w0", "b", 1, prompt=500))
    # the heartbeat includes both records: a running, b waiting with its whole prompt to compute
    apply_heartbeat(table, hb("w0", seq=2, held=2, active=1, waiting=1, prefill=500, ts_ms=2_000))
    assert figures(table, "w0") == (1, 1, 500, 0, 0)
    apply_inflight_record(table, finished("w0", "b", 2))
    assert figures(table, "w0") == (1, 0, 500, 0, 0)  # still bounded by a's prompt
    apply_inflight_record(table, finished("w0", "a", 3))
    assert figures(table, "w0") == IDLE  # the heartbeat's figures belonged to requests that ended


def test_prefill_bound_waits_for_a_finish():
    # A preempted request can have more to recompute than its prompt: the heartbeat stands until one ends.
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "a", 0, prompt=100))
    apply_heartbeat(table, hb("w0", seq=1, held=1, waiting=1, prefill=150, ts_ms=2_000))
    assert figures(table, "w0")[2] == 150


def test_cancelled_requests_leave_like_finished_ones():
    table = table_of("w0")
    route(table, "w0", "a")
    route(table, "w0", "b")
    apply_inflight_record(table, admitted("w0", "a", 0))
    apply_inflight_record(table, finished("w0", "a", 1, cancelled=True))
    # b was cancelled before the worker took it: its finish record (answered abort) comes without an admission
    apply_inflight_record(table, finished("w0", "b", 2, cancelled=True))
    assert figures(table, "w0") == IDLE


def test_admission_read_after_its_finish_is_ignored():
    table = table_of("w0")
    apply_inflight_record(table, finished("w0", "a", 1))
    apply_inflight_record(table, admitted("w0", "a", 0))  # reordered by a producer retry
    assert figures(table, "w0") == IDLE
    # ... unless this router sends the same id again (a client retry): then it is a new request
    route(table, "w0", "a")
    apply_inflight_record(table, admitted("w0", "a", 2))
    assert figures(table, "w0")[3] == 1


def test_finished_ids_are_bounded():
    table = table_of("w0")
    for i in range(FINISHED_REMEMBERED + 10):
        apply_inflight_record(table, finished("w0", f"r{i}", i))
    assert len(table.inflight.workers["w0"].finished) == FINISHED_REMEMBERED


# ---- heartbeat reconciliation -------------------------------------------------------------------

def test_heartbeat_covers_what_it_includes_and_no_more():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "a", 0, prefill=320))
    route(table, "w0", "b", prefill=100)
    apply_inflight_record(table, admitted("w0", "b", 2, prefill=100))  # seq 1 is another request, ended
    # the heartbeat was built after seq 0 and 1 only: b is not in its figures
    apply_heartbeat(table, hb("w0", seq=2, held=1, active=1, prefill=0, ts_ms=2_000))
    assert figures(table, "w0") == (1, 0, 0, 1, 100)
    apply_heartbeat(table, hb("w0", seq=3, held=2, active=1, waiting=1, prefill=100, ts_ms=3_000))
    assert figures(table, "w0") == (1, 1, 100, 0, 0)


def test_heartbeat_drops_entries_whose_finish_record_never_came():
    table = table_of("w0")
    for i, rid in enumerate("abc"):
        apply_inflight_record(table, admitted("w0", rid, i))
    # a's and b's finish records (seq 3, 4) were lost; the heartbeat says the worker held one request
    apply_heartbeat(table, hb("w0", seq=5, held=1, active=1, ts_ms=2_000))
    assert table.inflight.reconciled == 0  # records 3 and 4 may still be on their way
    apply_inflight_record(table, admitted("w0", "d", 5))  # the worker's records went on past seq 5
    assert table.inflight.reconciled == 2
    assert list(table.inflight.workers["w0"].admitted) == ["c", "d"]
    assert figures(table, "w0") == (1, 0, 0, 1, 320)


def test_heartbeat_reconciles_at_once_when_its_records_are_folded():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "a", 0))
    apply_heartbeat(table, hb("w0", seq=2, held=0, ts_ms=2_000))  # seq 1 (a's finish) is missing
    assert table.inflight.reconciled == 0
    apply_inflight_record(table, finished("w0", "a", 1))  # it was late, not lost: nothing dropped twice
    assert table.inflight.reconciled == 0 and figures(table, "w0") == IDLE


def test_heartbeat_counting_requests_not_yet_announced_drops_nothing():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "a", 0))
    apply_heartbeat(table, hb("w0", seq=1, held=3, active=1, ts_ms=2_000))  # two more taken, records to come
    assert table.inflight.reconciled == 0 and figures(table, "w0")[0] == 1


# ---- expiry, stop, restart ----------------------------------------------------------------------

def test_routed_entry_never_admitted_expires_at_the_worker_ttl():
    table = table_of("w0", ttl_ms=5_000)
    route(table, "w0", "a", now_ms=1_000)
    route(table, "w0", "b", now_ms=3_000)
    assert expire_inflight(table, 6_000) == []
    apply_heartbeat(table, hb("w0", ts_ms=6_000))
    assert expire_inflight(table, 6_001) == ["a"]
    assert figures(table, "w0")[3] == 1 and table.inflight.expired == 1
    apply_heartbeat(table, hb("w0", ts_ms=8_001))
    expire_workers(table, 8_001)
    assert figures(table, "w0") == IDLE


def test_admitted_entries_do_not_expire_with_time():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "long", 0))
    apply_heartbeat(table, hb("w0", seq=1, held=1, active=1, ts_ms=600_000))
    expire_inflight(table, 600_000)
    assert figures(table, "w0")[0] == 1


def test_stopped_and_expired_workers_take_their_entries_with_them():
    table = table_of("w0", "w1")
    route(table, "w0", "a")
    route(table, "w1", "b")
    apply_heartbeat(table, hb("w0", status=WorkerStatus.stopped, ts_ms=2_000))
    assert "w0" not in table.inflight.workers
    assert expire_workers(table, 1_000 + 5_001) == ["w1"]
    assert "w1" not in table.inflight.workers


def test_orphan_state_from_a_replayed_log_is_dropped():
    table = RoutingTable()
    apply_inflight_record(table, admitted("gone", "a", 0, ts_ms=1_000))
    expire_inflight(table, 1_000 + ORPHAN_TTL_MS)
    assert "gone" in table.inflight.workers
    expire_inflight(table, 1_001 + ORPHAN_TTL_MS)
    assert "gone" not in table.inflight.workers


def test_restart_drops_the_old_incarnation_and_ignores_its_late_records():
    table = table_of("w0")
    apply_inflight_record(table, admitted("w0", "lost", 0))  # taken, then the worker crashed
    route(table, "w0", "queued")  # still in the queue slot: the new incarnation will take it
    apply_heartbeat(table, hb("w0", started_ms=START + 1, seq=0, held=0, ts_ms=2_000))
    assert figures(table, "w0") == (0, 0, 0, 1, 320)
    apply_inflight_record(table, finished("w0", "x", 7))  # a late record of the old incarnation
    apply_inflight_record(table, admitted("w0", "queued", 0, started_ms=START + 1))
    assert list(table.inflight.workers["w0"].admitted) == ["queued"]
    assert figures(table, "w0")[3] == 1


# ---- determinism --------------------------------------------------------------------------------

def test_replicas_folding_the_same_log_agree_whatever_the_interleaving():
    """Heartbeats and inflight records come from two topics: each replica may read them interleaved
    differently; once both have read everything, their figures are the same."""
    records = [admitted("w0", "a", 0, prefill=300), admitted("w0", "b", 1, prefill=64), finished("w0", "a", 2),
               admitted("w0", "c", 3, prefill=10)]
    beat = hb("w0", seq=2, held=2, active=1, waiting=1, prefill=64, ts_ms=2_000)
    results = set()
    for at in range(len(records) + 1):
        table = table_of("w0")
        for r in records[:at]:
            apply_inflight_record(table, r)
        apply_heartbeat(table, beat)
        for r in records[at:]:
            apply_inflight_record(table, r)
        results.add(figures(table, "w0"))
    assert results == {(1, 0, 64, 1, 10)}


# ---- KV events before the next decision ---------------------------------------------------------

def test_kv_lagging_until_the_index_folds_the_batches_before_the_finish():
    table = table_of("w0", "w1")
    index = KvIndex(BS)
    apply_inflight_record(table, finished("w0", "a", 0, kv_event_id=3))  # batches 0..2 came before it
    apply_inflight_record(table, finished("w1", "b", 0, kv_event_id=0))  # an engine without KV events
    assert kv_lagging(table, index.last_event_id) == ["w0"]
    for event_id in range(3):
        index.apply(KvEventBatch(worker_id="w0", event_id=event_id, block_size=BS, ts_ms=0, events=[]))
        assert kv_lagging(table, index.last_event_id) == ([] if event_id == 2 else ["w0"])


def test_waived_worker_is_not_waited_for_until_its_cursor_moves():
    table = table_of("w0")
    index = KvIndex(BS)
    index.apply(KvEventBatch(worker_id="w0", event_id=0, block_size=BS, ts_ms=0, events=[]))
    apply_inflight_record(table, finished("w0", "a", 0, kv_event_id=5))
    waive_kv(table, "w0", index.last_event_id("w0"))
    assert kv_lagging(table, index.last_event_id) == []
    index.apply(KvEventBatch(worker_id="w0", event_id=1, block_size=BS, ts_ms=0, events=[]))
    assert kv_lagging(table, index.last_event_id) == ["w0"]


# ---- routing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["kv", "least_loaded"])
def test_a_prompt_repeated_between_heartbeats_stays_on_its_worker(policy):
    """The live failure this fixes: with a 1 s heartbeat, the worker that had just served a long prompt
    kept its last heartbeat's load (taken while it ran) plus every request routed to it since, so
    after two repetitions it looked busier than an idle worker and the prompt moved away."""
    tokens = list(range(2000))
    hashes = tuple(compute_block_hashes(tokens, BS))
    table = table_of("w0", "w1", "w2")
    index = KvIndex(BS)
    table.kv_index = index if policy == "kv" else None
    holder, seq = None, 0
    for i in range(5):
        req = RouteRequest(request_id=f"r{i}", model=MODEL, isl=len(tokens), block_hashes=hashes)
        d = select_worker(policy, req, table)
        holder = holder or d.worker_id
        assert d.worker_id == holder, f"repetition {i} moved"
        if policy == "kv" and i:
            assert d.overlap_blocks == len(hashes)
        prefill = len(tokens) - d.overlap_blocks * BS
        route(table, holder, req.request_id, prompt=len(tokens), prefill=prefill)
        apply_inflight_record(table, admitted(holder, req.request_id, seq, prompt=len(tokens), prefill=prefill))
        if i == 0:  # the only heartbeat: taken while the first request was prefilling
            apply_heartbeat(table, hb(holder, seq=seq + 1, held=1, active=1, prefill=2000, ts_ms=1_500))
            index.apply(KvEventBatch(worker_id=holder, event_id=0, block_size=BS, ts_ms=0,
                                     events=[BlockStored(block_hashes=list(hashes))]))
        apply_inflight_record(table, finished(holder, req.request_id, seq + 1, kv_event_id=1))
        seq += 2
    assert figures(table, holder) == IDLE


def test_a_burst_is_still_spread_before_any_record_comes_back():
    table = table_of("w0", "w1", "w2", "w3")
    chosen = []
    for i in range(8):
        d = select_worker("kv", RouteRequest(request_id=f"r{i}", model=MODEL, isl=640), table)
        route(table, d.worker_id, f"r{i}", prompt=640, prefill=640)
        chosen.append(d.worker_id)
    assert sorted(chosen) == sorted(itertools.chain.from_iterable([w] * 2 for w in ("w0", "w1", "w2", "w3")))


# ---- the offline simulator folds the same records -----------------------------------------------

@pytest.mark.parametrize("disagg", [False, True])
def test_simulator_feeds_the_tracker_and_ends_with_nothing_held(disagg):
    from kvflow.replay.simulator import SimConfig, Simulation
    from kvflow.replay.traces import TraceRequest
    from kvflow.workers.engines.mocker_core import MockerConfig

    shared = tuple(range(1, 1025))
    trace = [TraceRequest(request_id=f"r{i}", index=i, arrival_ms=i * 5.0, isl=1024 + 64 * (i % 3), osl=4,
                          token_ids=shared + tuple(range(5000 + 100 * i, 5000 + 100 * i + 64 * (i % 3))))
             for i in range(24)]
    config = SimConfig(workers=0 if disagg else 3, prefill_workers=2 if disagg else 0,
                       decode_workers=2 if disagg else 0, policy="kv",
                       mocker=MockerConfig(block_size=64, num_kv_blocks=2048))
    sim = Simulation(trace, config)
    result = sim.run()
    assert all(r.error is None for r in result.records)
    states = sim.table.inflight.workers
    assert set(states) == set(sim.workers)
    assert all(s.held() == 0 and s.seq_read == sim.workers[w].lifecycle_seq for w, s in states.items())
    assert sim.table.inflight.reconciled == 0
