"""The offline simulator's disaggregated mode: the live placement rule, hand-computed
remote-prefill timings, KV transfer size, equivalence with aggregated runs, determinism.

Expected times come from the step-time model as documented for the mocker
core (step = prefill(t) + decode(u); prefill = a·t² + b·t + c over uncached
tokens; decode = max(1, a·u² + b·u + c) at KV usage u) and the transfer model
(latency + tokens · bytes_per_token / bandwidth), with coefficients chosen
here, not read from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvflow.replay.offline import run_offline
from kvflow.replay.simulator import SimConfig, Simulation, simulate
from kvflow.replay.traces import TraceRequest
from kvflow.router.disagg import DisaggConfig
from kvflow.workers.engines.mocker_core import MockerConfig

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_first40min.jsonl"

BLOCKS = 1000
BS = 64
LATENCY_MS = 5.0
BYTES_PER_TOKEN = 1000
BANDWIDTH = 1e6  # bytes/s: 1 ms per token moved


def prefill_ms(t: int) -> float:
    return 2e-6 * t * t + 0.01 * t + 5.0 if t > 0 else 0.0


def decode_ms(used_blocks: int) -> float:
    u = used_blocks / BLOCKS
    return max(1.0, 10.0 * u * u + 20.0 * u + 3.0)


def transfer_ms(tokens: int) -> float:
    return LATENCY_MS + tokens * BYTES_PER_TOKEN / BANDWIDTH * 1000.0


def cfg(**kw) -> MockerConfig:
    base = {"block_size": BS, "num_kv_blocks": BLOCKS, "prefill_coeffs": (2e-6, 0.01, 5.0),
            "decode_coeffs": (10.0, 20.0, 3.0), "kv_bytes_per_token": BYTES_PER_TOKEN,
            "kv_transfer_bytes_per_s": BANDWIDTH, "kv_transfer_latency_ms": LATENCY_MS}
    base.update(kw)
    return MockerConfig(**base)


def req(i: int, arrival_ms: float, isl: int, osl: int, hash_ids: tuple[int, ...] | None = None) -> TraceRequest:
    return TraceRequest(request_id=f"r{i}", index=i, arrival_ms=arrival_ms, isl=isl, osl=osl,
                        hash_ids=hash_ids if hash_ids is not None else tuple(1000 + 10 * i + k for k in range(8)))


def by_id(result):
    return {r.request_id: r for r in result.records}


def test_short_prompt_local_long_remote_and_full_prefill_queue_local():
    reqs = [req(0, 0.0, 500, 2),  # short: the decode worker prefills it
            req(1, 10_000.0, 1500, 2),  # long, prefill pool idle: remote
            req(2, 20_000.0, 1500, 2), req(3, 20_000.0, 1500, 2)]  # r2 queued on the prefill worker, so r3 stays local
    res = simulate(reqs, SimConfig(workers=0, prefill_workers=1, decode_workers=1, mocker=cfg(),
                                   disagg=DisaggConfig(max_prefill_queue_per_worker=1)))
    r = by_id(res)
    assert [r[f"r{i}"].prefill_worker_id for i in range(4)] == ["", "prefill-000", "prefill-000", ""]
    assert {x.worker_id for x in res.records} == {"decode-000"}
    assert res.prefill_plans == {"short_prompt": 1, "remote": 2, "prefill_queue_full": 1}
    assert all(x.ok and x.output_tokens == 2 for x in res.records)
    # The prefill worker computed exactly the two remote prompts, the decode worker the two local ones
    # (imported prompts cost it no prefill tokens).
    assert res.prefill_tokens["prefill-000"] == 1500 + 1500
    assert res.prefill_tokens["decode-000"] == 500 + 1500
    assert res.worker_roles == {"prefill-000": "prefill", "decode-000": "decode"}


def test_threshold_follows_the_config():
    res = simulate([req(0, 0.0, 1500, 2)], SimConfig(workers=0, prefill_workers=1, decode_workers=1, mocker=cfg(),
                                                     disagg=DisaggConfig(prefill_threshold_tokens=1500)))
    assert res.prefill_plans == {"short_prompt": 1} and by_id(res)["r0"].prefill_worker_id == ""


@pytest.mark.parametrize("speedup", [1.0, 4.0])
def test_one_remote_request_timing_by_hand(speedup):
    isl, arrival = 1500, 1000.0
    res = simulate([req(0, arrival, isl, 3)],
                   SimConfig(workers=0, prefill_workers=1, decode_workers=1, mocker=cfg(speedup_ratio=speedup)))
    r = by_id(res)["r0"]
    blocks = math.ceil(isl / BS)  # 24 blocks: the prompt on the prefill worker; prompt + 2 fed-back tokens on decode
    prefill_step = (prefill_ms(isl) + decode_ms(blocks)) / speedup  # prefill-only: samples token 0, then done
    moved = transfer_ms(isl) / speedup  # the decode worker has nothing cached: the whole prompt moves
    first = arrival + prefill_step + moved
    assert r.scheduled_ms == arrival
    assert r.first_token_ms == pytest.approx(first)  # TTFT includes the transfer
    # Tokens 1 and 2: one decode step each on the decode worker, no prefill compute there.
    assert list(res.itl_gaps_ms) == pytest.approx([decode_ms(blocks) / speedup] * 2)
    assert r.finish_ms == pytest.approx(first + 2 * decode_ms(blocks) / speedup)
    assert (r.output_tokens, r.cached_tokens, r.error) == (3, 0, None)
    assert (r.worker_id, r.prefill_worker_id, r.kv_transfer_tokens) == ("decode-000", "prefill-000", isl)
    assert r.kv_transfer_ms == pytest.approx(moved)
    assert res.busy_ms["prefill-000"] == pytest.approx(prefill_step)
    assert res.busy_ms["decode-000"] == pytest.approx(2 * decode_ms(blocks) / speedup)
    assert res.prefill_tokens == {"prefill-000": isl, "decode-000": 0}
    assert res.decode_tokens == {"prefill-000": 0, "decode-000": 2}


def test_one_token_request_finishes_when_the_kv_arrives():
    res = simulate([req(0, 0.0, 1500, 1)], SimConfig(workers=0, prefill_workers=1, decode_workers=1, mocker=cfg()))
    r = by_id(res)["r0"]
    done = prefill_ms(1500) + decode_ms(24) + transfer_ms(1500)
    assert r.first_token_ms == pytest.approx(done) and r.finish_ms == pytest.approx(done)
    assert r.output_tokens == 1 and len(res.itl_gaps_ms) == 0
    assert res.busy_ms["decode-000"] == 0.0


def test_transfer_moves_only_what_the_decode_worker_lacks():
    shared = (1, 2, 3)
    reqs = [req(0, 0.0, 1500, 2, shared), req(1, 20_000.0, 2000, 2, shared + (9,))]
    res = simulate(reqs, SimConfig(workers=0, prefill_workers=1, decode_workers=1, policy="round_robin",
                                   mocker=cfg()))
    r0, r1 = by_id(res)["r0"], by_id(res)["r1"]
    # round_robin knows no overlap, so both go remote; r0's prompt blocks stay cached on both workers.
    reused = (1500 // BS) * BS  # 23 full blocks of the shared 1500-token prefix: 1472 tokens
    assert r0.prefill_worker_id and r1.prefill_worker_id
    assert (r0.kv_transfer_tokens, r1.kv_transfer_tokens) == (1500, 2000 - reused)
    assert r1.kv_transfer_ms == pytest.approx(transfer_ms(2000 - reused))
    assert r1.cached_tokens == reused  # the prefill worker's hit, as the live final response reports it


def test_kv_policy_keeps_a_mostly_cached_prompt_local():
    shared = (1, 2, 3)
    reqs = [req(0, 0.0, 1500, 2, shared), req(1, 20_000.0, 1600, 2, shared + (4,))]
    res = simulate(reqs, SimConfig(workers=0, prefill_workers=1, decode_workers=2, policy="kv", mocker=cfg()))
    r0, r1 = by_id(res)["r0"], by_id(res)["r1"]
    # r1's decode worker already holds 1472 tokens of its prompt (from r0's imported KV): 128 uncached.
    assert r0.prefill_worker_id == "prefill-000" and r1.prefill_worker_id == ""
    assert r1.worker_id == r0.worker_id
    assert r1.cached_tokens == (1500 // BS) * BS
    assert res.prefill_plans == {"remote": 1, "short_prompt": 1}


def _synthetic(n: int) -> list[TraceRequest]:
    # Mixed lengths, shared prefixes, overlapping in time.
    return [req(i, i * 37.0, 300 + (i * 397) % 2500, 2 + (i * 7) % 40, (i % 5, 100 + i % 3) + tuple(200 + 10 * i + k for k in range(4)))
            for i in range(n)]


@pytest.mark.parametrize("policy", ["kv", "least_loaded"])
def test_all_local_disaggregated_run_equals_the_aggregated_run(policy):
    trace = _synthetic(60)
    agg = simulate(trace, SimConfig(workers=3, policy=policy, mocker=cfg()))
    # Decode workers with no prefill pool, and with an idle prefill pool behind an unreachable threshold.
    for extra in ({}, {"prefill_workers": 2, "disagg": DisaggConfig(prefill_threshold_tokens=10**6)}):
        dis = simulate(trace, SimConfig(workers=0, decode_workers=3, policy=policy, mocker=cfg(), **extra))
        a, d = by_id(agg), by_id(dis)
        for rid, ra in a.items():
            rd = d[rid]
            assert rd.worker_id == ra.worker_id.replace("worker-", "decode-")
            assert (rd.first_token_ms, rd.finish_ms, rd.cached_tokens, rd.output_tokens, rd.prefill_worker_id) == (
                ra.first_token_ms, ra.finish_ms, ra.cached_tokens, ra.output_tokens, "")
        assert list(dis.itl_gaps_ms) == list(agg.itl_gaps_ms)
        assert sum(dis.prefill_plans.values()) == 60 and "remote" not in dis.prefill_plans
        assert all(dis.busy_ms[w] == 0.0 for w in dis.worker_ids if w.startswith("prefill-"))


def test_aggregated_workers_decode_beside_a_prefill_pool():
    trace = [req(i, i * 50.0, 1200 + 100 * i, 4) for i in range(6)]
    res = simulate(trace, SimConfig(workers=2, prefill_workers=1, policy="round_robin", mocker=cfg()))
    remote = [r for r in res.records if r.prefill_worker_id]
    assert remote and all(r.worker_id.startswith("worker-") and r.ok for r in res.records)
    assert res.worker_ids == ["worker-000", "worker-001", "prefill-000"]


def test_worker_counts_are_checked():
    with pytest.raises(ValueError):
        Simulation([req(0, 0.0, 100, 2)], SimConfig(workers=0, prefill_workers=2))
    with pytest.raises(ValueError):
        Simulation([req(0, 0.0, 100, 2)], SimConfig(workers=1, decode_workers=-1))


def _report(tmp_path: Path, name: str, **kw) -> dict:
    run_offline(MOONCAKE, policy="kv", limit=150, json_path=tmp_path / name, progress=False, **kw)
    data = json.loads((tmp_path / name).read_text())
    data.pop("wall_time_s")
    data["options"].pop("profile_s")
    return data


def test_disaggregated_replay_is_deterministic_and_reported(tmp_path):
    kw = {"workers": 0, "prefill_workers": 1, "decode_workers": 2, "seed": 3}
    a, b = _report(tmp_path, "a.json", **kw), _report(tmp_path, "b.json", **kw)
    assert a == b
    d = a["disagg"]
    assert a["completed"] == 150 and a["workers"] == 3
    assert d["remote_prefills"] > 0 and d["local_prefills"] > 0
    assert d["remote_prefills"] + d["local_prefills"] == 150
    assert [p["role"] for p in d["pools"]] == ["prefill", "decode"]
    assert d["pools"][0]["requests"] == d["remote_prefills"] and d["pools"][1]["requests"] == 150
    assert d["kv_transfer_ms"]["count"] == d["remote_prefills"] and d["kv_transfer_ms"]["p50"] > 0
    assert a["options"]["prefill_workers"] == 1 and a["options"]["decode_workers"] == 2
    assert _report(tmp_path, "agg.json", workers=3)["disagg"] is None


def test_cli_disaggregated_run(tmp_path):
    from kvflow.cli import app

    out = tmp_path / "cli.json"
    result = CliRunner().invoke(app, [
        "replay", str(MOONCAKE), "--mode", "offline", "--prefill-workers", "1", "--decode-workers", "1",
        "--disagg-threshold-tokens", "4000", "--policy", "kv", "--limit", "40", "--json", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["workers"] == 2 and data["options"]["aggregated_workers"] == 0
    assert data["disagg"]["prefill_threshold_tokens"] == 4000
    assert "Disaggregation" in result.output and "| prefill | 1 |" in result.output
    # With the SLA planner, prefill and decode workers are sized apart (kvflow.replay.pool_planner).
    planned = CliRunner().invoke(app, ["replay", str(MOONCAKE), "--prefill-workers", "1", "--decode-workers", "1",
                                       "--workers", "0", "--planner", "sla", "--limit", "40", "--no-progress",
                                       "--json", str(tmp_path / "planned.json")])
    assert planned.exit_code == 0, planned.output
    assert "| (default) | prefill |" in planned.output and "| (default) | decode |" in planned.output
    pool = json.loads((tmp_path / "planned.json").read_text())["pools"][""]["planner"]
    assert set(pool["replica_hours"]) == set(pool["max_workers"]) == {"prefill", "decode"}
    assert min(pool["max_workers"].values()) >= 1 and pool["requests"] == 40
