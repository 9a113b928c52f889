"""The SLA planner sizing each worker pool of an offline replay from that pool's own load
(kvflow.replay.pool_planner), in aggregated and disaggregated modes, on slowed-down
mocker engines (the profile and engine of test_planner_offline)."""

from __future__ import annotations

import json
import zlib

import pytest
from typer.testing import CliRunner

from kvflow.planner.core import PlannerConfig
from kvflow.replay.pool_planner import PoolPlannerHook, run_pool_planner
from kvflow.replay.simulator import SimConfig
from kvflow.replay.traces import TraceRequest
from kvflow.router.disagg import DisaggConfig
from kvflow.router.pools import DecodeGrid, PoolGrid, PrefillGrid
from kvflow.router.shedding import ShedConfig
from kvflow.schemas import WorkerRole
from tests.test_planner_offline import MOCKER, OSL, perf, write_azure  # noqa: F401 - the shared profile fixture

A, P, D = WorkerRole.aggregated, WorkerRole.prefill, WorkerRole.decode
# prompts under 1024 tokens (with their outputs) go to "short", longer ones to "long"
GRID = PoolGrid(prefill=PrefillGrid(isl_step_tokens=1024, ttft_step_ms=10_000, grid=[["short"], ["long"]]),
                decode=DecodeGrid(context_step_tokens=1024, itl_step_ms=10_000, grid=[["short"], ["long"]]))


def spell(start_s: float, end_s: float, rate: float, isl: int, tag: str) -> list[TraceRequest]:
    """Evenly spaced requests with distinct prompts (the index seeds their tokens: no prefix is shared)."""
    n = round((end_s - start_s) * rate)
    base = zlib.crc32(f"{tag}{start_s}".encode()) * 10_000
    return [TraceRequest(request_id=f"{tag}{start_s:.0f}-{k:04d}", index=base + k,
                         arrival_ms=(start_s + k / rate) * 1000.0, isl=isl, osl=OSL) for k in range(n)]


def config(**kw) -> PlannerConfig:
    base = {"ttft_ms": 1000.0, "itl_ms": 100.0, "adjustment_interval_s": 10.0, "mode": "aggregated",
            "min_aggregated_replicas": 1, "max_gpus": 8, "scale_down_hold_intervals": 2}
    return PlannerConfig(**(base | kw))


def test_each_pool_is_sized_from_its_own_load(perf):  # noqa: F811
    short = spell(0, 180, 2.0, 256, "s")  # steady on the short pool
    long = spell(0, 60, 1.0, 1024, "l") + spell(60, 120, 6.0, 1024, "b") + spell(120, 180, 1.0, 1024, "l")
    trace = sorted(short + long, key=lambda r: r.arrival_ms)
    sim = SimConfig(workers=0, mocker=MOCKER, pool_grid=GRID)
    run = run_pool_planner(trace, sim, {"short": config(), "long": config()}, perf,
                           initial={"short": {A: 1}, "long": {A: 1}}, sla_ttft_ms=1000.0, sla_itl_ms=100.0)
    assert all(r.ok for r in run.result.records)
    pools = run.result.worker_pools
    assert {pools[r.worker_id] for r in run.result.records if r.isl == 256} == {"short"}
    assert {pools[r.worker_id] for r in run.result.records if r.isl == 1024} == {"long"}

    def targets(pool: str, lo_s: float, hi_s: float) -> list[int]:
        return [t.target_replicas for t in run.hook.ticks if t.pool == pool and lo_s < t.t_s <= hi_s]

    assert max(targets("long", 70, 130)) > max(targets("long", 0, 60))  # the burst scaled its own pool ...
    assert max(targets("short", 0, 180)) == min(targets("short", 20, 180))  # ... and left the other alone
    assert any(t > 0 for t in run.hook.reactive_ms["long"]) and not run.hook.reactive_ms["short"]
    figures = {p: f.as_dict() for p, f in run.pools.items()}
    assert figures["short"]["requests"] == len(short) and figures["long"]["requests"] == len(long)
    assert figures["long"]["max_workers"]["aggregated"] > figures["short"]["max_workers"]["aggregated"]
    assert run.replica_hours == pytest.approx(sum(sum(f["replica_hours"].values()) for f in figures.values()),
                                              abs=1e-3)


def test_a_disaggregated_pool_sizes_prefill_from_its_remote_prefills(perf):  # noqa: F811
    # short prompts prefill on the decode workers; a spell of long ones goes to the prefill pool
    trace = sorted(spell(0, 150, 2.0, 256, "s") + spell(50, 100, 8.0, 1024, "l"), key=lambda r: r.arrival_ms)
    sim = SimConfig(workers=0, mocker=MOCKER, shed=ShedConfig(kv_threshold=1.0),  # engines queue, none shed
                    disagg=DisaggConfig(prefill_threshold_tokens=512, max_prefill_queue_per_worker=64))
    cfg = config(mode="disaggregated", min_prefill_replicas=1, min_decode_replicas=1)
    run = run_pool_planner(trace, sim, {"": cfg}, perf, initial={"": {P: 1, D: 1}}, sla_ttft_ms=2000.0,
                           sla_itl_ms=200.0, fast_interval_s=None)
    recs = run.result.records
    assert all(r.ok for r in recs)
    assert {bool(r.prefill_worker_id) for r in recs if r.isl == 1024} == {True}
    assert not any(r.prefill_worker_id for r in recs if r.isl == 256)
    prefill_ticks = [t for t in run.hook.ticks if t.role is P]
    decode_ticks = [t for t in run.hook.ticks if t.role is D]
    # the prefill pool counts only the remote prefills; the decode pool every request it decoded
    seen = [r for r in recs if r.finish_ms < max(t.t_s for t in decode_ticks) * 1000]  # before the last tick
    assert sum(t.finished_requests for t in prefill_ticks) == sum(1 for r in seen if r.prefill_worker_id)
    assert sum(t.finished_requests for t in decode_ticks) == len(seen) >= len(recs) - 2
    assert all(t.finished_requests == 0 for t in prefill_ticks if t.t_s <= 50 or t.t_s > 110)
    # 8 req/s x 1024 tokens: about 2 prefill replicas' work (4,440 tokens/s each at the TTFT goal)
    assert max(t.target_replicas for t in prefill_ticks if 50 < t.t_s <= 110) >= 2
    assert max(t.target_replicas for t in prefill_ticks if t.t_s > 140) == 1
    assert set(run.pools[""].replica_hours) == {"prefill", "decode"}


def test_pools_must_share_one_tick_and_mode(perf):  # noqa: F811
    with pytest.raises(ValueError, match="adjustment_interval_s"):
        PoolPlannerHook({"a": config(), "b": config(adjustment_interval_s=5.0)}, perf)
    with pytest.raises(ValueError, match="same mode"):
        PoolPlannerHook({"a": config(), "b": config(mode="disaggregated")}, perf)


def test_replay_with_worker_pools_reports_each_pools_planner(perf, tmp_path):  # noqa: F811
    from kvflow.cli import app

    trace = sorted(spell(0, 60, 2.0, 256, "s") + spell(20, 40, 6.0, 1024, "l"), key=lambda r: r.arrival_ms)
    csv = write_azure(tmp_path / "mixed.csv", trace)
    grid = tmp_path / "grid.json"
    grid.write_text(GRID.model_dump_json(), encoding="utf-8")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, [
        "replay", str(csv), "--mode", "offline", "--planner", "sla", "--ttft-ms", "1000", "--itl-ms", "100",
        "--adjustment-interval-s", "10", "--workers", "0", "--pool-workers", "short=1,long=1",
        "--pool-grid", str(grid), "--max-workers", "6", "--speedup-ratio", "0.1", "--json", str(out),
        "--markdown", str(tmp_path / "r.md"), "--no-progress"])
    assert result.exit_code == 0, result.output
    pools = json.loads(out.read_text())["pools"]
    assert set(pools) == {"short", "long"}
    assert pools["short"]["planner"]["requests"] == 120 and pools["long"]["planner"]["requests"] == 120
    assert all(set(p["planner"]["replica_hours"]) == {"aggregated"} for p in pools.values())
    assert "| long | aggregated |" in (tmp_path / "r.md").read_text()
