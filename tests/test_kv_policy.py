"""KV-aware routing policies ``kv`` and ``approx`` over a real routing table and index."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from kvflow.router import kv_policy
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.router.index import KvIndex
from kvflow.router.kv_policy import (
    ApproxKvIndex,
    KvPolicyConfig,
    make_approx_policy,
    make_kv_policy,
)
from kvflow.router.policies import POLICIES, RouteRequest, select_worker
from kvflow.router.table import RoutingTable, apply_heartbeat, note_routed
from kvflow.schemas import (
    BlockStored,
    KvEventBatch,
    KvTier,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)

BS = 16
MODEL = "m"

if "now_ms" in {f.name for f in dataclasses.fields(RouteRequest)}:
    Req = RouteRequest
else:  # until RouteRequest carries the decision time, tests add it the same way
    @dataclasses.dataclass(frozen=True)
    class Req(RouteRequest):  # type: ignore[no-redef]
        now_ms: int = 0


def heartbeat(worker_id: str, *, used: int = 0, total: int = 1000, active: int = 0, waiting: int = 0,
              prefill_tokens: int = 0, ts_ms: int = 1) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=WorkerRole.aggregated, status=WorkerStatus.serving, model=MODEL,
                           engine="mocker", block_size=BS, kv_total_blocks=total, kv_used_blocks=used,
                           queue_topic="q", queue_partition=0, active_requests=active, waiting_requests=waiting,
                           active_prefill_tokens=prefill_tokens, ts_ms=ts_ms)


def table_with(*hbs: WorkerHeartbeat, index=None) -> RoutingTable:
    table = RoutingTable()
    for hb in hbs:
        apply_heartbeat(table, hb)
    table.kv_index = index
    return table


TOKENS = list(range(320))  # 20 blocks of 16
HASHES = tuple(compute_block_hashes(TOKENS, BS))


def store(index: KvIndex, worker: str, n: int, tier: KvTier = KvTier.device, event_id: int = 0) -> None:
    index.apply(KvEventBatch(worker_id=worker, event_id=event_id, block_size=BS, ts_ms=0,
                             events=[BlockStored(block_hashes=list(HASHES[:n]), tier=tier)]))


def request(rid: str = "r1", hashes: tuple[int, ...] = HASHES, isl: int = len(TOKENS), **kw) -> RouteRequest:
    return Req(request_id=rid, model=MODEL, isl=isl, block_hashes=hashes, **kw)


def test_policies_are_registered():
    assert "kv" in POLICIES and "approx" in POLICIES
    assert kv_policy.EVENT_POLICIES == {"kv"}


def test_kv_routes_to_the_worker_holding_the_prefix():
    index = KvIndex(BS)
    store(index, "w1", 15)
    store(index, "w2", 4)
    table = table_with(heartbeat("w0"), heartbeat("w1"), heartbeat("w2"), index=index)
    d = select_worker("kv", request(), table)
    assert d.worker_id == "w1" and d.policy == "kv" and d.overlap_blocks == 15
    # cost of w1 by the documented formula: (20 - 15) new blocks, nothing queued, no decode load
    assert d.cost == pytest.approx(5.0)


def test_cost_formula_and_load_outweighing_a_small_overlap():
    cfg = kv_policy.DEFAULT_KV_CONFIG
    index = KvIndex(BS)
    store(index, "w0", 2)
    table = table_with(heartbeat("w0", active=1, prefill_tokens=32), heartbeat("w1"), index=index)
    req = request(isl=330)  # ceil(330 / 16) = 21 prefill blocks
    costs = kv_policy.worker_costs(req, table.candidates(MODEL, WorkerRole.aggregated), index.find_matches(HASHES),
                                   cfg)
    w0 = cfg.prefill_load_scale * (21 - 2 + cfg.queue_weight * 32 / BS) + cfg.decode_weight * 1
    w1 = cfg.prefill_load_scale * 21
    assert costs == pytest.approx([w0, w1])
    assert select_worker("kv", req, table).worker_id == "w1"  # 2 cached blocks do not pay for the load
    # a long overlap does
    store(index, "w0", 20, event_id=1)
    d = select_worker("kv", req, table)
    assert d.worker_id == "w0" and d.overlap_blocks == 20


def test_requests_routed_since_the_heartbeat_count_as_load():
    table = table_with(heartbeat("w0"), heartbeat("w1"), index=KvIndex(BS))
    first = select_worker("kv", request("a"), table)
    note_routed(table, first.worker_id)
    second = select_worker("kv", request("b"), table)
    assert {first.worker_id, second.worker_id} == {"w0", "w1"}


def test_cold_start_is_least_loaded_by_cost_with_id_tie_break():
    table = table_with(heartbeat("w2"), heartbeat("w1"), heartbeat("w0", active=2))
    d = select_worker("kv", request(), table)  # no index at all
    assert d.worker_id == "w1" and d.overlap_blocks == 0
    table.kv_index = KvIndex(BS)  # empty index, same answer
    assert select_worker("kv", request(), table).worker_id == "w1"
    assert select_worker("kv", request(hashes=()), table).worker_id == "w1"


def test_host_and_disk_overlap_earn_partial_credit():
    index = KvIndex(BS)
    store(index, "w0", 10, KvTier.host)
    store(index, "w1", 10, KvTier.disk)
    table = table_with(heartbeat("w0"), heartbeat("w1"), heartbeat("w2"), index=index)
    cfg = KvPolicyConfig()
    d = select_worker("kv", request(), table)
    assert d.worker_id == "w0" and d.overlap_blocks == 0  # overlap_blocks counts device blocks only
    assert d.cost == pytest.approx(20 - cfg.host_weight * 10)
    costs = kv_policy.worker_costs(request(), table.candidates(MODEL, "aggregated"), index.find_matches(HASHES), cfg)
    assert costs[1] == pytest.approx(20 - cfg.disk_weight * 10) and costs[2] == pytest.approx(20)


def test_temperature_sampling_is_deterministic_per_request_id():
    index = KvIndex(BS)
    store(index, "w0", 8)
    hbs = [heartbeat(f"w{i}", active=i) for i in range(4)]
    policy = make_kv_policy(KvPolicyConfig(temperature=0.5), "kv_t")
    picks = []
    for rid in (f"req-{i}" for i in range(400)):
        a = policy(request(rid), table_with(*hbs, index=index).candidates(MODEL, "aggregated"),
                   table_with(*hbs, index=index))
        b = policy(request(rid), table_with(*hbs, index=index).candidates(MODEL, "aggregated"),
                   table_with(*hbs, index=index))
        assert a == b  # same id, fresh tables: same draw
        picks.append(a.worker_id)
    counts = Counter(picks)
    assert len(counts) == 4  # every worker gets some
    assert counts["w0"] == max(counts.values())  # the cheapest most often


def test_choose_probabilities_follow_the_softmax():
    costs = [0.0, 5.0, 10.0]
    n = 4000
    counts = Counter(kv_policy.choose(f"x{i}", costs, 1.0) for i in range(n))
    weights = [math.exp(-c / 10.0) for c in costs]
    for i, w in enumerate(weights):
        assert counts[i] / n == pytest.approx(w / sum(weights), abs=0.03)
    assert kv_policy.choose("y", [3.0, 1.0, 1.0], 0.0) == 1
    assert kv_policy.choose("y", [2.0, 2.0], 1.0) in (0, 1)


def test_kv_rejects_a_foreign_index():
    table = table_with(heartbeat("w0"), index=ApproxKvIndex(BS))
    with pytest.raises(TypeError, match="KvIndex"):
        select_worker("kv", request(), table)


def test_config_rejects_negative_weights():
    with pytest.raises(ValueError, match="decode_weight"):
        KvPolicyConfig(decode_weight=-1)


def test_approx_follows_its_own_decisions():
    table = table_with(heartbeat("w0"), heartbeat("w1"), heartbeat("w2"))
    first = select_worker("approx", request("a", now_ms=1_000), table)
    assert first.overlap_blocks == 0 and isinstance(table.kv_index, ApproxKvIndex)
    note_routed(table, first.worker_id)
    # a heartbeat arrives: the load is gone again, only the predicted cache differs
    for w in ("w0", "w1", "w2"):
        apply_heartbeat(table, heartbeat(w, ts_ms=2))
    second = select_worker("approx", request("b", now_ms=2_000), table)
    assert second.worker_id == first.worker_id and second.overlap_blocks == len(HASHES)
    assert second.policy == "approx"


def test_approx_predictions_expire_after_the_ttl():
    policy = make_approx_policy(KvPolicyConfig(approx_ttl_ms=10_000), "approx_short")
    table = table_with(heartbeat("w0"), heartbeat("w1"))
    cands = table.candidates(MODEL, "aggregated")
    first = policy(request("a", now_ms=0), cands, table)
    assert policy(request("b", now_ms=9_999), cands, table).overlap_blocks == len(HASHES)
    # "b" refreshed the prediction to expire at 19_999
    assert policy(request("c", now_ms=19_998), cands, table).overlap_blocks == len(HASHES)
    late = policy(request("d", now_ms=40_000), cands, table)
    assert late.overlap_blocks == 0
    assert first.worker_id == "w0"


def test_approx_capacity_bound_and_worker_removal():
    approx = ApproxKvIndex(BS, ttl_ms=10**9)
    approx.record("w0", HASHES, now_ms=0, capacity_blocks=12)
    # the prompt's tail was dropped first: the head is still predicted
    assert dict(approx.find_matches(HASHES, now_ms=1).device) == {"w0": 12}
    table = table_with(heartbeat("w1"), index=approx)  # w0 left the table
    d = select_worker("approx", request("z", now_ms=5), table)
    assert d.worker_id == "w1" and "w0" not in approx.workers()


def test_approx_rejects_an_event_fed_index():
    table = table_with(heartbeat("w0"), index=KvIndex(BS))
    with pytest.raises(TypeError, match="ApproxKvIndex"):
        select_worker("approx", request(), table)


def test_table_weights_replace_the_registered_defaults():
    # w0: one running request; w1: a 64-token prompt queued. With the default
    # decode weight 8, w0 costs 20 + 8 = 28 and w1 20 + 0.5 * 4 = 22: w1 wins.
    table = table_with(heartbeat("w0", active=1), heartbeat("w1", prefill_tokens=64), index=KvIndex(BS))
    assert select_worker("kv", request(), table).worker_id == "w1"
    # weighing a running request as 1 block makes w0 the cheaper (21 vs 22)
    table.kv_config = KvPolicyConfig(decode_weight=1.0)
    d = select_worker("kv", request(), table)
    assert d.worker_id == "w0" and d.cost == pytest.approx(21.0)
    fresh = table_with(heartbeat("w0", active=1), heartbeat("w1", prefill_tokens=64))
    assert select_worker("approx", request(now_ms=0), fresh).worker_id == "w1"
    fresh.kv_config = KvPolicyConfig(decode_weight=1.0)
    other = tuple(compute_block_hashes([t + 1000 for t in TOKENS], BS))  # a prompt not predicted on w1
    assert select_worker("approx", request("r2", hashes=other, now_ms=0), fresh).worker_id == "w0"


def test_weights_come_from_the_settings(monkeypatch):
    from kvflow.settings import Settings

    monkeypatch.setenv("KVFLOW_KV_DECODE_WEIGHT", "2.5")
    monkeypatch.setenv("KVFLOW_KV_TEMPERATURE", "0.1")
    monkeypatch.setenv("KVFLOW_KV_STALL_WEIGHT", "0.5")
    cfg = KvPolicyConfig.from_settings(Settings())
    assert (cfg.decode_weight, cfg.temperature, cfg.queue_weight, cfg.overlap_credit) == (2.5, 0.1, 0.5, 1.0)
    assert cfg.stall_weight == 0.5 and KvPolicyConfig().stall_weight == 20.0
    assert KvPolicyConfig.from_settings(Settings(kv_queue_weight=0)).queue_weight == 0


def with_exposure(table: RoutingTable, worker_id: str, exposure: float) -> RoutingTable:
    """``table`` with ``worker_id``'s stall exposure set (what its inflight records would give)."""
    table.workers[worker_id] = dataclasses.replace(table.workers[worker_id], stall_exposure=exposure)
    return table


def test_the_stall_term_keeps_a_prefill_away_from_short_answers_it_would_stall():
    # w0 holds 10 of the 20 prompt blocks and runs one request; w1 is idle and holds nothing.
    index = KvIndex(BS)
    store(index, "w0", 10)
    table = table_with(heartbeat("w0", active=1), heartbeat("w1"), index=index)
    # w0's request decodes 5 tokens: 10 uncached blocks would stretch its mean ITL by a quarter of their
    # prefill time, 10 + 8 + 20 * 10 * (1/4) = 68 > 20 on the idle w1
    with_exposure(table, "w0", 1 / 4)
    d = select_worker("kv", request(), table)
    assert d.worker_id == "w1" and d.cost == pytest.approx(20.0)
    w0 = {c.worker_id: c for c in d.candidates}["w0"]
    assert (w0.stall_exposure, w0.cost) == (pytest.approx(0.25), pytest.approx(68.0))
    # a long answer barely notices: 10 + 8 + 20 * 10 / 1000 = 18.2 < 20, the prefix wins
    with_exposure(table, "w0", 1 / 1000)
    assert select_worker("kv", request(), table).worker_id == "w0"
    # weight 0 turns the term off, whatever is held
    with_exposure(table, "w0", 1 / 4)
    table.kv_config = KvPolicyConfig(stall_weight=0)
    assert select_worker("kv", request(), table).worker_id == "w0"
    with pytest.raises(ValueError, match="stall_weight"):
        KvPolicyConfig(stall_weight=-0.1)


# --- per-candidate terms (the routing-decisions record) -----------------------------------------------------------


def recomputed(cfg: KvPolicyConfig, t) -> float:
    """A candidate's cost from its published terms, by the documented formula."""
    return (cfg.prefill_load_scale * (t.prefill_blocks + cfg.queue_weight * t.queued_prefill_blocks)
            + cfg.decode_weight * t.decode_requests + cfg.stall_weight * t.prefill_blocks * t.stall_exposure)


@pytest.mark.parametrize("stall_weight", [0.0, 20.0])
@pytest.mark.parametrize("policy", ["kv", "approx"])
def test_candidate_terms_reproduce_every_cost_and_the_chosen_one(policy, stall_weight):
    cfg = KvPolicyConfig(stall_weight=stall_weight)
    index = KvIndex(BS)
    store(index, "w1", 12)
    table = table_with(heartbeat("w0", active=1, prefill_tokens=48), heartbeat("w1", active=2, waiting=1),
                       heartbeat("w2"), index=index if policy == "kv" else None)
    note_routed(table, "w2")  # a request routed since w2's heartbeat: queued prefill and decode load
    with_exposure(table, "w1", 0.5)  # w1's requests would be stalled by this prefill
    table.kv_config = cfg
    req = request(isl=330, now_ms=1)
    d = select_worker(policy, req, table)
    terms = {t.worker_id: t for t in d.candidates}
    assert list(terms) == ["w0", "w1", "w2"]  # one per candidate, worker-id order
    for t in terms.values():
        assert t.cost == pytest.approx(recomputed(cfg, t))
    chosen = terms[d.worker_id]
    assert d.cost == chosen.cost == min(t.cost for t in terms.values())
    assert d.overlap_blocks == chosen.overlap_blocks
    # the costs are worker_costs'
    scores = index.find_matches(HASHES) if policy == "kv" else kv_policy._NO_SCORES
    assert [t.cost for t in d.candidates] == pytest.approx(
        kv_policy.worker_costs(req, table.candidates(MODEL, WorkerRole.aggregated), scores, cfg))
    w0, w1, w2 = terms["w0"], terms["w1"], terms["w2"]
    assert (w0.prefill_blocks, w0.queued_prefill_blocks, w0.decode_requests) == (21, 48 / BS, 1)
    assert w2.queued_prefill_blocks == 21 and w2.decode_requests == 1 and w2.load == 1  # sized like this request
    assert w1.load == 3 and w1.decode_requests == 2 and w1.stall_exposure == 0.5 and w0.stall_exposure == 0
    if policy == "kv":
        assert (w1.overlap_blocks, w1.prefill_blocks) == (12, 21 - 12)
    assert w0.host_overlap_blocks is None and w0.disk_overlap_blocks is None  # no host or disk tier reported


def test_candidate_terms_show_host_and_disk_overlap():
    index = KvIndex(BS)
    store(index, "w0", 10, KvTier.host)
    store(index, "w1", 6, KvTier.disk)
    table = table_with(heartbeat("w0"), heartbeat("w1"), index=index)
    cfg = KvPolicyConfig()
    d = select_worker("kv", request(), table)
    w0, w1 = d.candidates
    assert (w0.host_overlap_blocks, w0.disk_overlap_blocks, w0.overlap_blocks) == (10, 0, 0)
    assert (w1.host_overlap_blocks, w1.disk_overlap_blocks) == (0, 6)
    assert w0.prefill_blocks == pytest.approx(20 - cfg.host_weight * 10) == pytest.approx(w0.cost)


def test_simple_policies_list_each_candidates_load():
    table = table_with(heartbeat("w0", active=2), heartbeat("w1", waiting=1))
    for name in ("round_robin", "random", "least_loaded"):
        d = select_worker(name, request(), table)
        assert [(t.worker_id, t.load) for t in d.candidates] == [("w0", 2), ("w1", 1)]
        if name == "least_loaded":
            assert [t.cost for t in d.candidates] == [2.0, 1.0] and d.cost == 1.0
        else:
            assert all(t.cost is None for t in d.candidates)


def test_candidate_terms_stay_off_the_wire():
    from kvflow.schemas import InferenceRequest, ReplyTo, RoutingDecision, decode, encode

    table = table_with(heartbeat("w0"), heartbeat("w1"), index=KvIndex(BS))
    d = select_worker("kv", request(), table)
    assert d.candidates
    routed = InferenceRequest(request_id="r1", model=MODEL, token_ids=TOKENS, reply_to=ReplyTo(topic="t", partition=0),
                              routing=d)
    wire = encode(routed)
    assert b"candidates" not in wire and b"queued_prefill" not in wire
    back = decode(InferenceRequest, wire).routing
    assert back == RoutingDecision(worker_id=d.worker_id, policy="kv", overlap_blocks=d.overlap_blocks, cost=d.cost)


def test_tier_weights_come_from_settings():
    from kvflow.settings import Settings

    cfg = KvPolicyConfig.from_settings(Settings())
    assert (cfg.host_weight, cfg.disk_weight) == (0.75, 0.25)
    blind = KvPolicyConfig.from_settings(Settings(kv_host_weight=0, kv_disk_weight=0))
    assert (blind.host_weight, blind.disk_weight) == (0.0, 0.0)
