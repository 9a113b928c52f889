"""The offline simulator: timings against hand-computed formulas, routing, hooks, determinism.

Expected times are computed here from the step-time model as documented for
the mocker core (duration = prefill(t) + decode(u), prefill = a·t² + b·t + c
over uncached prompt tokens, decode = max(1, a·u² + b·u + c) at KV usage u),
with coefficients chosen by the test, not read from the code under test.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from kvflow.replay.offline import run_offline
from kvflow.replay.plots import latency_samples, write_plots
from kvflow.replay.report import build_report
from kvflow.replay.simulator import SimConfig, Simulation, simulate
from kvflow.replay.traces import TraceRequest, read_trace
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.router import policies
from kvflow.router.policies import request_rng
from kvflow.schemas import BlockStored
from kvflow.workers.engines.mocker_core import MockerConfig

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"

PREFILL = (2e-6, 0.01, 5.0)  # ms = 2e-6·t² + 0.01·t + 5
DECODE = (10.0, 20.0, 3.0)  # ms = 10·u² + 20·u + 3
BLOCKS = 1000
BS = 64


def prefill_ms(t: int) -> float:
    return 2e-6 * t * t + 0.01 * t + 5.0 if t > 0 else 0.0


def decode_ms(used_blocks: int) -> float:
    u = used_blocks / BLOCKS
    return max(1.0, 10.0 * u * u + 20.0 * u + 3.0)


def cfg(**kw) -> MockerConfig:
    base = dict(block_size=BS, num_kv_blocks=BLOCKS, prefill_coeffs=PREFILL, decode_coeffs=DECODE)
    base.update(kw)
    return MockerConfig(**base)


def req(i: int, arrival_ms: float, isl: int, osl: int, hash_ids: tuple[int, ...] | None = None) -> TraceRequest:
    return TraceRequest(request_id=f"r{i}", index=i, arrival_ms=arrival_ms, isl=isl, osl=osl,
                        hash_ids=hash_ids if hash_ids is not None else (1000 + 10 * i, 1001 + 10 * i))


def by_id(result):
    return {r.request_id: r for r in result.records}


def test_single_request_timing_matches_the_formulas():
    res = simulate([req(0, 1000.0, 1000, 3)], SimConfig(workers=1, mocker=cfg()))
    r = by_id(res)["r0"]
    used = math.ceil(1000 / BS)  # 16 blocks hold the prompt and the 2 fed-back tokens (1002 <= 1024)
    first = prefill_ms(1000) + decode_ms(used)
    assert r.scheduled_ms == 1000.0
    assert r.first_token_ms - r.arrival_ms == pytest.approx(first)  # TTFT
    assert list(res.itl_gaps_ms) == pytest.approx([decode_ms(used)] * 2)
    assert r.finish_ms - r.arrival_ms == pytest.approx(first + 2 * decode_ms(used))
    assert (r.output_tokens, r.cached_tokens, r.error) == (3, 0, None)
    assert res.busy_ms["worker-000"] == pytest.approx(first + 2 * decode_ms(used))


def test_speedup_ratio_divides_step_times():
    res = simulate([req(0, 0.0, 1000, 2)], SimConfig(workers=1, mocker=cfg(speedup_ratio=4.0)))
    r = by_id(res)["r0"]
    assert r.first_token_ms == pytest.approx((prefill_ms(1000) + decode_ms(16)) / 4)
    assert list(res.itl_gaps_ms) == pytest.approx([decode_ms(16) / 4])


def test_chunked_prefill_splits_a_long_prompt():
    # 3000 tokens with a 2048-token step budget: 2048 in step 1 (no token), 952 in step 2 (+ first token).
    res = simulate([req(0, 0.0, 3000, 1, hash_ids=(1, 2, 3, 4, 5, 6))],
                   SimConfig(workers=1, mocker=cfg(max_num_batched_tokens=2048)))
    assert by_id(res)["r0"].first_token_ms == pytest.approx(prefill_ms(2048) + prefill_ms(952) + decode_ms(47))


def test_shared_prefix_is_served_from_cache():
    same = (5, 6)
    res = simulate([req(0, 0.0, 1000, 3, same), req(1, 10_000.0, 1000, 3, same)],
                   SimConfig(workers=1, mocker=cfg()))
    first, second = by_id(res)["r0"], by_id(res)["r1"]
    cached = (1000 - 1) // BS * BS  # full blocks, leaving at least one token to compute: 960
    assert (first.cached_tokens, second.cached_tokens) == (0, cached)
    assert second.first_token_ms - second.arrival_ms == pytest.approx(prefill_ms(1000 - cached) + decode_ms(16))
    report = build_report(res.records, res.itl_gaps_ms, mode="offline", trace="t", trace_format="mooncake",
                          policy="round_robin", workers=res.worker_ids, seed=0)
    assert report.prefix_hit_rate == pytest.approx(cached / 2000)


def test_broker_hop_delays_the_engine_and_the_routers_view():
    # hop_ms: the router decides one hop after the arrival, the engine gets the request one hop after the
    # decision, and the workers' KV events reach the router one hop after their step.
    same = (5, 6)
    alone = by_id(simulate([req(0, 0.0, 1000, 3, same)], SimConfig(workers=1, mocker=cfg())))["r0"]
    hopped = by_id(simulate([req(0, 0.0, 1000, 3, same)], SimConfig(workers=1, mocker=cfg(), hop_ms=40.0)))["r0"]
    assert hopped.first_token_ms - hopped.arrival_ms == pytest.approx(alone.first_token_ms + 80.0)
    assert hopped.finish_ms - hopped.arrival_ms == pytest.approx(alone.finish_ms + 80.0)
    # A repeat of the prompt arriving just after the first one finished: without hops the router has its
    # blocks and sends the repeat there; one hop of 1 s later it has neither the blocks nor the finish
    # record, so the first worker still looks busy and the repeat goes to the other one, uncached.
    repeat = [req(0, 0.0, 1000, 3, same), req(1, alone.finish_ms + 1.0, 1000, 3, same)]
    at_once = by_id(simulate(repeat, SimConfig(workers=2, policy="kv", mocker=cfg())))
    late = by_id(simulate(repeat, SimConfig(workers=2, policy="kv", mocker=cfg(), hop_ms=1000.0)))
    assert at_once["r1"].worker_id == at_once["r0"].worker_id and at_once["r1"].cached_tokens > 0
    assert late["r1"].worker_id != late["r0"].worker_id and late["r1"].cached_tokens == 0
    assert all(r.error is None for r in [*at_once.values(), *late.values()])


def test_hop_settings_are_checked():
    with pytest.raises(ValueError, match="hop_ms"):
        SimConfig(hop_ms=-1.0)
    with pytest.raises(ValueError, match="heartbeat_interval_ms"):
        SimConfig(heartbeat_interval_ms=0.0)


def test_queueing_delay_when_the_engine_is_full():
    # One sequence at a time: r1 waits until r0 has finished its 3 tokens.
    res = simulate([req(0, 0.0, 1000, 3), req(1, 0.0, 1000, 2)],
                   SimConfig(workers=1, mocker=cfg(max_num_seqs=1)))
    r0, r1 = by_id(res)["r0"], by_id(res)["r1"]
    r0_done = prefill_ms(1000) + 3 * decode_ms(16)
    assert r0.finish_ms == pytest.approx(r0_done)
    assert r1.scheduled_ms == pytest.approx(r0_done)  # queue delay = r0's whole life
    assert r1.first_token_ms == pytest.approx(r0_done + prefill_ms(1000) + decode_ms(16))


def test_simultaneous_arrivals_share_the_first_step():
    res = simulate([req(0, 0.0, 500, 1), req(1, 0.0, 500, 1)], SimConfig(workers=1, mocker=cfg()))
    r0, r1 = by_id(res)["r0"], by_id(res)["r1"]
    # Both prompts in one step of 1000 prefill tokens; 8 blocks each.
    assert r0.first_token_ms == r1.first_token_ms == pytest.approx(prefill_ms(1000) + decode_ms(16))


def test_round_robin_spreads_evenly_and_uses_the_real_table():
    reqs = [req(i, i * 5.0, 200, 4) for i in range(80)]
    sim = Simulation(reqs, SimConfig(workers=8, policy="round_robin", mocker=cfg()))
    res = sim.run()
    counts = Counter(r.worker_id for r in res.records)
    assert sorted(counts.values()) == [10] * 8 and len(counts) == 8
    assert sorted(sim.table.workers) == [f"worker-{i:03d}" for i in range(8)]
    assert [r.worker_id for r in sorted(res.records, key=lambda r: r.arrival_ms)][:9] == [
        f"worker-{i % 8:03d}" for i in range(9)]


def test_random_policy_follows_the_request_seeded_choice():
    reqs = [req(i, i * 5.0, 200, 2) for i in range(40)]
    res = simulate(reqs, SimConfig(workers=4, policy="random", mocker=cfg()))
    workers = [f"worker-{i:03d}" for i in range(4)]
    assert {r.request_id: r.worker_id for r in res.records} == {
        r.request_id: request_rng(r.request_id).choice(workers) for r in res.records}


def test_least_loaded_sees_engine_load_refreshed_at_each_decision():
    # r0 is long; r1 short and finished before r2 arrives, so worker-001 is idle again.
    reqs = [req(0, 0.0, 200, 500), req(1, 100.0, 200, 2), req(2, 500.0, 200, 2)]
    res = simulate(reqs, SimConfig(workers=2, policy="least_loaded", mocker=cfg()))
    assert [by_id(res)[f"r{i}"].worker_id for i in range(3)] == ["worker-000", "worker-001", "worker-001"]


def test_router_sees_the_prefill_of_a_step_in_flight():
    # r0's 4000-token prefill runs in one step of about 77 ms; r1 arrives 10 ms into it.
    reqs = [req(i, t, isl, 2, tuple(range(10 * i, 10 * i + 10))) for i, (t, isl) in
            enumerate([(0.0, 4000), (10.0, 100), (500.0, 100)])]
    seen: dict[str, dict[str, int]] = {}

    def capture(req_, candidates, table):
        seen[req_.request_id] = {w.worker_id: w.active_prefill_tokens for w in candidates}
        return policies.POLICIES["round_robin"](req_, candidates, table)

    policies.register_policy("_capture_prefill")(capture)
    try:
        simulate(reqs, SimConfig(workers=2, policy="_capture_prefill", mocker=cfg()))
    finally:
        del policies.POLICIES["_capture_prefill"]
    assert seen["r1"] == {"worker-000": 4000, "worker-001": 0}
    assert seen["r2"] == {"worker-000": 0, "worker-001": 0}


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_kv_events(self, worker_id, events):
        self.events.extend((worker_id, e) for e in events)


def test_kv_hook_receives_the_engines_block_hashes():
    hook = Recorder()
    r = req(0, 0.0, 1000, 2, (21, 22))
    simulate([r], SimConfig(workers=1, mocker=cfg()), kv_hook=hook)
    stored = [h for w, e in hook.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert all(w == "worker-000" for w, _ in hook.events)
    assert stored[:15] == compute_block_hashes(r.prompt_token_ids(), BS)


def test_kv_aware_policies_get_block_hashes():
    reqs = [req(0, 0.0, 1100, 2, (3, 4, 5))]
    seen = []

    def capture(req_, candidates, table):
        seen.append(req_.block_hashes)
        return policies.POLICIES["round_robin"](req_, candidates, table)

    policies.register_policy("_capture_test")(capture)
    try:  # a policy outside HASH_FREE_POLICIES gets hashes without asking
        simulate(reqs, SimConfig(workers=1, policy="_capture_test", mocker=cfg()))
    finally:
        del policies.POLICIES["_capture_test"]
    assert list(seen[0]) == compute_block_hashes(reqs[0].prompt_token_ids(), BS)


class AddOneWorker:
    interval_ms = 1000.0

    def __init__(self) -> None:
        self.ticks: list[float] = []

    def on_tick(self, now_ms, sim):
        self.ticks.append(now_ms)
        if len(sim.workers) == 1:
            sim.add_worker()


def test_planner_hook_can_add_workers(tmp_path):
    planner = AddOneWorker()
    reqs = [req(i, i * 400.0, 100, 2) for i in range(8)]
    res = simulate(reqs, SimConfig(workers=1, policy="round_robin", mocker=cfg(), sample_interval_ms=500.0),
                   planner=planner)
    assert planner.ticks[:2] == [1000.0, 2000.0]
    early = {r.worker_id for r in res.records if r.arrival_ms < 1000.0}
    late = [r.worker_id for r in res.records if r.arrival_ms > 1000.0]
    assert early == {"worker-000"} and "worker-001" in late and res.worker_ids == ["worker-000", "worker-001"]
    assert all(r.ok for r in res.records)
    # samples at 500, 1000 (taken before the tick at 1000) and 1500 ms: the timeline grows with the pool
    assert [len(s.load) for s in res.timeline][:3] == [1, 1, 2]
    report = build_report(res.records, res.itl_gaps_ms, mode="offline", trace="t", trace_format="mooncake",
                          policy="round_robin", workers=res.worker_ids, seed=0, timeline=res.timeline)
    assert [p.name for p in write_plots(report, latency_samples(res.records, res.itl_gaps_ms), tmp_path)] == [
        "latency_cdf.png", "timeline.png"]


def test_a_started_worker_takes_requests_only_after_its_startup_time():
    # added at the 1000 ms tick, ready at 1000 + 1500 = 2500 ms: requests at 1200..2400 ms stay on worker-000
    planner = AddOneWorker()
    reqs = [req(i, i * 400.0, 100, 2) for i in range(12)]
    res = simulate(reqs, SimConfig(workers=1, policy="round_robin", mocker=cfg(), worker_startup_ms=1500.0),
                   planner=planner)
    starting = {r.worker_id for r in res.records if r.arrival_ms < 2500.0}
    ready = [r.worker_id for r in res.records if r.arrival_ms >= 2500.0]
    assert starting == {"worker-000"} and "worker-001" in ready and all(r.ok for r in res.records)
    with pytest.raises(ValueError, match="worker_startup_ms"):
        SimConfig(worker_startup_ms=-1.0)


def test_a_simulation_runs_once():
    sim = Simulation([req(0, 0.0, 100, 2)], SimConfig(workers=1, mocker=cfg()))
    sim.run()
    with pytest.raises(RuntimeError):
        sim.run()


def test_oversized_request_fails_cleanly():
    res = simulate([req(0, 0.0, BLOCKS * BS + 10, 2, tuple(range(200))), req(1, 1.0, 100, 2)],
                   SimConfig(workers=1, mocker=cfg()))
    bad, good = by_id(res)["r0"], by_id(res)["r1"]
    assert bad.error and "KV blocks" in bad.error and not bad.ok
    assert good.ok


def test_same_seed_gives_identical_report(tmp_path):
    def run(seed: int, name: str) -> dict:
        run_offline(TRACES / "mooncake_conversation_first40min.jsonl", workers=4, policy="random", seed=seed,
                    limit=150, json_path=tmp_path / name, progress=False)
        data = json.loads((tmp_path / name).read_text())
        data.pop("wall_time_s")
        data["options"].pop("profile_s")
        return data

    a, b = run(7, "a.json"), run(7, "b.json")
    assert a == b
    assert a["completed"] == 150


def test_one_big_worker_hits_every_previously_seen_prefix():
    # A pool large enough to never evict, and a fast engine so requests rarely overlap: the cache hit of
    # each request is then the longest prefix of its 64-token blocks seen in any earlier request.
    trace = read_trace(TRACES / "mooncake_conversation_first40min.jsonl", limit=400)
    seen: set[int] = set()
    cached = prompt = 0
    for r in trace.requests:
        hashes = compute_block_hashes(r.prompt_token_ids(), 64)
        n = 0
        for h in hashes[: (r.isl - 1) // 64]:
            if h not in seen:
                break
            n += 1
        cached, prompt = cached + 64 * n, prompt + r.isl
        seen.update(hashes)
    res = simulate(trace, SimConfig(workers=1, mocker=MockerConfig(num_kv_blocks=200_000, speedup_ratio=100.0)))
    sim_cached = sum(r.cached_tokens for r in res.records)
    assert cached / prompt > 0.1  # the trace really shares prefixes (13.7% over the first 400)
    assert sim_cached <= cached and sim_cached / prompt == pytest.approx(cached / prompt, abs=0.005)


def test_kv_weights_reach_the_simulated_router():
    from kvflow.router.kv_policy import KvPolicyConfig

    def run(kv_config):
        return run_offline(TRACES / "azure2023_conv.csv", workers=4, policy="kv", limit=600, progress=False,
                           mocker_config=MockerConfig(speedup_ratio=0.25), kv_config=kv_config)

    default, decode_blind = run(None), run(KvPolicyConfig(decode_weight=0.0))
    assert "kv_weights" not in default.options and decode_blind.options["kv_weights"]["decode_weight"] == 0.0
    # no prefix is shared on this trace, so the load terms alone decide: without
    # the decode term the workers' shares change
    assert [w.requests for w in default.per_worker] != [w.requests for w in decode_blind.per_worker]
    assert run(KvPolicyConfig()).per_worker == default.per_worker  # explicit defaults = no config


def test_replay_reports_shed_and_queued_requests_with_a_small_queue(tmp_path):
    from typer.testing import CliRunner

    from kvflow.cli import app

    # Eight 20,000-token prompts 1 ms apart onto 2 workers. A worker is busy once its first prefill
    # chunk (8,192 tokens = 128 blocks) holds more than 0.5% of its 16,384 blocks, so: two are routed,
    # three wait in the queue (capacity 3) for a tick to release them, three are shed.
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 20_000, "output_length": 2,
                                         "hash_ids": list(range(100 * i, 100 * i + 40))}) + "\n" for i in range(8)))
    out = tmp_path / "burst.json"
    result = CliRunner().invoke(app, [
        "replay", str(trace), "--mode", "offline", "--workers", "2", "--policy", "round_robin", "--no-progress",
        "--shed-mode", "queue", "--shed-queue-capacity", "3", "--shed-kv-threshold", "0.005", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "- router: 3 shed, 3 queued" in result.output
    report = json.loads(out.read_text())
    assert (report["shed"], report["queued"], report["completed"], report["failed"]) == (3, 3, 5, 3)
    assert report["options"]["shed"]["mode"] == "queue" and report["options"]["router"]["released"] == 3
    # The held requests waited for a router tick (every simulated second): their TTFT shows it.
    assert report["ttft_ms"]["p99"] > 1000.0


def test_default_replay_sheds_nothing_and_says_so():
    report = run_offline(TRACES / "mooncake_conversation_first40min.jsonl", workers=2, policy="kv", limit=30,
                         progress=False)
    assert (report.shed, report.queued) == (0, 0) and report.options["shed"]["mode"] == "reject"
