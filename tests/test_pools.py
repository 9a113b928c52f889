"""The global router's pool grid: cells, clamping, defaults, the config file, routing within pools."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from kvflow.router.core import Arrival, RouterCore
from kvflow.router.pools import PoolChoice, PoolGrid, grid_cell, load_pool_grid
from kvflow.schemas import DecisionOutcome, WorkerHeartbeat, WorkerRole

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pools.toml"
LL, LC = "low-latency", "long-context"


@pytest.fixture(scope="module")
def grid() -> PoolGrid:
    return load_pool_grid(EXAMPLE)


def test_grid_cell_floors_and_clamps():
    assert [grid_cell(v, 10, 3) for v in (-5, 0, 9.99, 10, 29, 30, 10**9)] == [0, 0, 0, 1, 2, 2, 2]


@pytest.mark.parametrize("isl,ttft_ms,pool", [
    (1, None, LL),          # row 0, default TTFT 1000 ms → column 1
    (4095, 100, LL),        # last token of row 0
    (4096, 100, LC),        # first token of row 1, tight TTFT (column 0)
    (4096, 499.9, LC),      # last value of column 0
    (4096, 500, LL),        # first value of column 1
    (4096, None, LL),       # default TTFT → column 1
    (8191, 10_000, LL),
    (8192, 10_000, LC),     # row 2: long-context whatever the target
    (10**6, 1, LC),         # clamped to the last row
])
def test_prefill_grid_boundaries(grid, isl, ttft_ms, pool):
    assert grid.prefill.pool(isl, ttft_ms) == pool


@pytest.mark.parametrize("context,itl_ms,pool", [
    (0, None, LL),
    (8191, 5, LL),          # last token of row 0
    (8192, 5, LC),          # first token of row 1
    (8192, None, LC),
    (10**7, 10**4, LC),     # clamped to the last row and column
])
def test_decode_grid_boundaries(grid, context, itl_ms, pool):
    assert grid.decode.pool(context, itl_ms) == pool


def test_choose_reads_context_as_isl_plus_max_tokens(grid):
    assert grid.choose(isl=100, max_tokens=8091) == PoolChoice(LL, LL)
    assert grid.choose(isl=100, max_tokens=8092) == PoolChoice(LL, LC)
    assert grid.pool_names() == {LL, LC}


def test_bad_grids_are_refused(tmp_path):
    good = json.loads(json.dumps(PoolGrid.model_validate(
        {"prefill": {"isl_step_tokens": 1, "ttft_step_ms": 1, "grid": [["a"]]},
         "decode": {"context_step_tokens": 1, "itl_step_ms": 1, "grid": [["a"]]}}).model_dump()))
    for broken in ({"grid": [["a", "b"], ["c"]]}, {"grid": []}, {"isl_step_tokens": 0}, {"unknown": 1}):
        data = json.loads(json.dumps(good))
        data["prefill"].update(broken)
        with pytest.raises(pydantic.ValidationError):
            PoolGrid.model_validate(data)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(good))
    assert load_pool_grid(path).decode.pool(5, None) == "a"


# ---- routing within pools ------------------------------------------------------------


def hb(worker_id: str, pool: str, slot: int) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=WorkerRole.aggregated, model="m", engine="mocker",
                           block_size=16, kv_total_blocks=1000, queue_topic="q", queue_partition=slot,
                           ts_ms=1_000, ttl_ms=60_000, started_ms=1, lifecycle_seq=0, pool=pool)


def arrival(rid: str, isl: int, max_tokens: int = 100, ttft: float | None = None) -> Arrival:
    return Arrival(rid, "m", isl, token_ids=list(range(isl)), payload=rid, max_tokens=max_tokens,
                   ttft_target_ms=ttft)


def test_long_requests_land_on_the_long_context_pool_and_short_ones_on_the_low_latency_pool(grid):
    core = RouterCore("least_loaded", pools=grid)
    for i, (wid, pool) in enumerate((("ll-0", LL), ("ll-1", LL), ("lc-0", LC))):
        core.on_heartbeat(hb(wid, pool, i))
    short = [core.route(arrival(f"s{i}", 500), 2_000 + i) for i in range(4)]
    long = [core.route(arrival(f"l{i}", 9_000), 2_100 + i) for i in range(3)]
    assert {d.target.worker_id for d in short} == {"ll-0", "ll-1"}
    assert {d.target.worker_id for d in long} == {"lc-0"}
    assert short[0].pools == PoolChoice(LL, LL) and long[0].pools == PoolChoice(LC, LC)


def test_a_pool_without_workers_falls_back_to_every_pool(grid):
    core = RouterCore("least_loaded", pools=grid)
    core.on_heartbeat(hb("ll-0", LL, 0))
    d = core.route(arrival("l", 9_000), 2_000)
    assert d.outcome is DecisionOutcome.routed and d.target.worker_id == "ll-0"
    assert d.pools.fallback and core.counters["pool_fallbacks"] == 1
    assert core.table.pools is None  # the filter never outlives a decision


def test_replay_places_each_request_in_its_pool_and_reports_per_pool(grid):
    from kvflow.replay.pool_report import pool_report
    from kvflow.replay.simulator import SimConfig, simulate
    from kvflow.replay.traces import TraceRequest

    trace = [TraceRequest(request_id=f"r{i}", index=i, arrival_ms=50.0 * i, isl=9_000 if i % 4 == 0 else 600,
                          osl=32) for i in range(40)]
    res = simulate(trace, SimConfig(workers=0, policy="kv", pool_grid=grid, pool_workers={LL: 2, LC: 1}))
    pools = res.worker_pools
    for rec in res.records:
        assert rec.ok and pools[rec.worker_id] == (LC if rec.isl == 9_000 else LL)
    report = pool_report(res.records, pools)
    assert report[LC]["completed"] == 10 and report[LL]["completed"] == 30
    assert report[LC]["ttft_p50_ms"] > report[LL]["ttft_p50_ms"]


def test_offline_replay_reports_each_pool(tmp_path, grid):
    from kvflow.replay.offline import run_offline
    from kvflow.replay.report import render_markdown

    trace = tmp_path / "mix.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 9_000 if i % 5 == 0 else 700,
                                         "output_length": 16, "hash_ids": list(range(i * 20, i * 20 + 18))}) + "\n"
                             for i in range(30)))
    report = run_offline(trace, workers=0, policy="kv", progress=False, pool_grid=grid,
                         pool_workers={LL: 1, LC: 1})
    assert report.pools[LC]["completed"] == 6 and report.pools[LL]["completed"] == 24
    assert "| long-context | 6 |" in render_markdown(report)


def test_evaluate_decides_within_the_pools_and_counts_nothing(grid):
    core = RouterCore("least_loaded", pools=grid)
    for i, (wid, pool) in enumerate((("ll-0", LL), ("lc-0", LC))):
        core.on_heartbeat(hb(wid, pool, i))
    assert core.evaluate(arrival("l", 9_000), 2_000).decision.worker_id == "lc-0"
    assert core.evaluate(arrival("s", 500), 2_001).decision.worker_id == "ll-0"
    assert core.table.pools is None and core.counters["routed"] == 0
