"""The SLA planner inside offline replay: scaling on the simulated clock, drains,
replica-hours, the live loop's window statistics, reports and determinism.

Engines are mocker cores with step-time coefficients chosen here and slowed
down (``speedup_ratio`` < 1), so that a few hundred requests need several
replicas and every test runs in seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvflow.planner.core import PlannerConfig, Prediction, initial_state, pool_needs
from kvflow.planner.interpolation import PerfFamily, PerfModel
from kvflow.planner.queries import interval_aggregates
from kvflow.replay.offline import run_offline
from kvflow.replay.planner_eval import (
    SlaPlannerHook,
    aggregated_mocker_profile,
    interval_aggregates_from_records,
    replica_hours,
    replica_steps,
    run_with_planner,
    smallest_static_pool,
    warm_start_replicas,
    worker_lifetimes,
)
from kvflow.replay.report import RequestRecord, load_report, meets_sla
from kvflow.replay.simulator import SimConfig, Simulation, simulate
from kvflow.replay.traces import Trace, TraceRequest, read_trace
from kvflow.router.shedding import ShedConfig
from kvflow.schemas import WorkerRole
from kvflow.schemas.metrics import RequestMetrics
from kvflow.workers.engines.mocker_core import MockerConfig

MOCKER = MockerConfig(block_size=64, num_kv_blocks=2000, prefill_coeffs=(2e-6, 0.01, 5.0),
                      decode_coeffs=(10.0, 20.0, 3.0), speedup_ratio=0.1)
# prefill of 512 new tokens: (2e-6*512^2 + 0.01*512 + 5) / 0.1 = 106 ms; a decode step >= 30 ms
ISL, OSL = 512, 16


def req(i: int, arrival_ms: float, isl: int = ISL, osl: int = OSL) -> TraceRequest:
    return TraceRequest(request_id=f"r{i:04d}", index=i, arrival_ms=arrival_ms, isl=isl, osl=osl)


def phases(*segments: tuple[float, float, float]) -> list[TraceRequest]:
    """Evenly spaced arrivals: each segment is (start s, end s, requests/s)."""
    out: list[TraceRequest] = []
    for start_s, end_s, rate in segments:
        n = round((end_s - start_s) * rate)
        out += [req(len(out) + k, (start_s + k / rate) * 1000.0) for k in range(n)]
    return out


@pytest.fixture(scope="module")
def perf() -> PerfModel:
    return PerfModel.from_profile(aggregated_mocker_profile(
        MOCKER, osl=OSL, isls=(256, 512, 1024), concurrencies=(1, 2, 4, 8, 16, 32), min_requests=16))


def planner_config(**kw) -> PlannerConfig:
    base = {"ttft_ms": 1000.0, "itl_ms": 100.0, "adjustment_interval_s": 10.0, "mode": "aggregated",
            "min_aggregated_replicas": 1, "max_gpus": 8, "scale_down_hold_intervals": 2}
    return PlannerConfig(**(base | kw))


# ---- scaling on the simulated clock -------------------------------------------


def test_scales_up_on_a_burst_and_back_down_after_it(perf):
    trace = phases((0, 60, 1.0), (60, 120, 10.0), (120, 240, 1.0))
    run = run_with_planner(trace, SimConfig(workers=1, mocker=MOCKER), planner_config(), perf, fast_interval_s=None)
    ticks = run.hook.ticks
    assert [t.t_s for t in ticks[:4]] == [10.0, 20.0, 30.0, 40.0]  # every interval of simulated time

    quiet = [t for t in ticks if t.t_s <= 60.0]
    burst = [t for t in ticks if 60.0 < t.t_s <= 130.0]
    after = [t for t in ticks if t.t_s > 190.0]
    assert all(t.target_replicas == 1 for t in quiet)
    assert max(t.target_replicas for t in burst) >= 3
    assert ticks[-1].target_replicas == 1 and all(t.target_replicas == 1 for t in after)
    # observed = finished requests per second: the arrival rate once the pool keeps up (a backlog
    # drains faster right after a scale-up)
    assert all(t.observed_rate_per_s == pytest.approx(1.0) for t in quiet)
    assert all(t.observed_rate_per_s == pytest.approx(10.0, rel=0.1) for t in burst if 90.0 < t.t_s <= 120.0)

    # workers start on ticks during the burst and are drained on ticks after the load fell
    assert run.hook.started_ms and all(60_000 < t <= 130_000 and t % 10_000 == 0 for t in run.hook.started_ms.values())
    assert run.hook.drained_ms and min(run.hook.drained_ms.values()) > max(run.hook.started_ms.values())
    # anti-flapping: a scale-down follows `hold` ticks whose need was below the running target
    for prev, cur in itertools.pairwise(ticks):
        if cur.target_replicas < prev.target_replicas:
            i = ticks.index(cur)
            assert all(t.needed_replicas < prev.target_replicas for t in ticks[i - 1:i + 1])

    # the applied targets are what served: serving workers after each tick equal its target
    steps = replica_steps(run.lifetimes, run.hook.drained_ms)
    for t in ticks:
        serving = [s.serving for s in steps if s.t_s <= t.t_s][-1]
        assert serving == t.target_replicas
    assert all(r.ok and r.output_tokens == OSL for r in run.result.records)  # nothing lost to scaling


def test_a_pool_scaled_to_zero_holds_requests_and_serves_them_after_a_cold_start(perf):
    startup_s = 5.0
    trace = phases((0, 20, 2.0), (150, 170, 2.0))  # two busy spells, 130 s apart
    sim = SimConfig(workers=0, mocker=MOCKER, worker_startup_ms=startup_s * 1000,
                    shed=ShedConfig(mode="queue", cold_start_hold_ms=120_000))
    run = run_with_planner(trace, sim, planner_config(min_aggregated_replicas=0, worker_startup_s=startup_s), perf)
    recs = run.result.records
    assert all(r.ok and r.output_tokens == OSL for r in recs)  # none shed, none lost
    assert run.result.router_counts["cold_held"] >= 2 and run.result.router_counts["rejected"] == 0
    steps = replica_steps(run.lifetimes, run.hook.drained_ms)
    assert steps[0].live == 0 or steps[0].t_s > 0  # nothing runs before the first request
    assert any(s.live == 0 and 40 < s.t_s < 150 for s in steps)  # idle: scaled to zero (and drained)
    # each spell's first request waits for a cold start: start-up plus at most a fast check and a router tick
    for first in (recs[0], next(r for r in recs if r.arrival_ms >= 150_000)):
        wait_s = (first.first_token_ms - first.arrival_ms) / 1000
        assert startup_s <= wait_s <= startup_s + 3.0
    starts_s = sorted(t / 1000 for t in run.hook.started_ms.values())
    assert starts_s[0] <= 1.0 and any(150.0 <= t <= 151.0 for t in starts_s)


def test_warm_start_sizes_the_first_interval_as_the_planner_would(perf):
    cfg = planner_config()
    busy = Trace("t", "", "synthetic", phases((0, 10, 20.0), (10, 60, 1.0)))  # the first 10 s interval: 200 requests
    need = pool_needs(initial_state(cfg, perf), Prediction(20.0, ISL, OSL, 0.0))[WorkerRole.aggregated][0]
    assert warm_start_replicas(busy, cfg, perf) == math.ceil(need) > 1
    assert warm_start_replicas(Trace("t", "", "synthetic", phases((20, 30, 1.0))), cfg, perf) == 1  # idle: the minimum
    assert warm_start_replicas(busy, planner_config(max_gpus=2), perf) == 2  # capped


def test_scaling_changes_the_outcome(perf):
    """The planner's extra workers are real: the same burst on one fixed worker misses the SLA far more."""
    trace = phases((0, 30, 1.0), (30, 90, 10.0), (90, 120, 1.0))
    planned = run_with_planner(trace, SimConfig(workers=1, mocker=MOCKER), planner_config(), perf)
    fixed = simulate(trace, SimConfig(workers=1, mocker=MOCKER))
    fixed_ok = sum(meets_sla(r, 1000.0, 100.0) for r in fixed.records) / len(trace)
    assert planned.sla_attainment > fixed_ok + 0.2


# ---- drains ------------------------------------------------------------------


class DrainFirstWorker:
    """Drains worker-000 at the first tick and does nothing else."""

    interval_ms = 1000.0

    def __init__(self) -> None:
        self.ticks: list[float] = []

    def on_tick(self, now_ms, sim):
        if not self.ticks:
            sim.drain_worker("worker-000")
        self.ticks.append(now_ms)


def test_a_drained_worker_finishes_every_request_it_holds():
    mocker = MockerConfig(block_size=64, num_kv_blocks=2000, prefill_coeffs=(2e-6, 0.01, 5.0),
                          decode_coeffs=(10.0, 20.0, 3.0), speedup_ratio=0.1, max_num_seqs=2)
    trace = [req(i, 25.0 + i * 50.0) for i in range(40)]  # 20 before the drain at 1 s, 20 after
    res = Simulation(trace, SimConfig(workers=2, mocker=mocker), planner=DrainFirstWorker()).run()
    drained = [r for r in res.records if r.worker_id == "worker-000"]
    assert len(drained) == 10 and all(r.arrival_ms < 1000.0 for r in drained)
    assert all(r.worker_id == "worker-001" for r in res.records if r.arrival_ms >= 1000.0)
    # some were still queued (two seats only) when the drain came, and all completed in full
    assert any(r.scheduled_ms > 1000.0 for r in drained)
    assert all(r.ok and r.output_tokens == OSL for r in res.records)
    life = worker_lifetimes(res.records, res.worker_ids, res.end_ms, drained_ms={"worker-000": 1000.0})
    assert life["worker-000"] == (0.0, max(r.finish_ms for r in drained))
    assert life["worker-001"] == (0.0, res.end_ms)


# ---- replica-hours -----------------------------------------------------------


def rec(rid: str, worker: str, arrival: float, finish: float | None, **kw) -> RequestRecord:
    return RequestRecord(rid, arrival, 100, 4, worker_id=worker, first_token_ms=kw.pop("first", None),
                         last_token_ms=finish, finish_ms=finish, **kw)


def test_replica_hours_against_a_hand_computed_case():
    # w0: the initial pool, live the whole run (0..36 s)
    # w1: started at 6 s, drained at 18 s, its last request finished at 21.6 s -> live 15.6 s
    # w2: started at 9 s, drained at 12 s with nothing in flight               -> live 3 s
    # w3: started at 30 s, still serving at the end (36 s)                      -> live 6 s
    records = [rec("a", "w0", 0.0, 5_000.0), rec("b", "w1", 7_000.0, 21_600.0), rec("c", "w1", 8_000.0, 9_000.0),
               rec("d", "w3", 31_000.0, 32_000.0), rec("e", "", 1_000.0, None, error="no worker")]
    life = worker_lifetimes(records, ["w0", "w1", "w2", "w3"], 36_000.0,
                            started_ms={"w1": 6_000.0, "w2": 9_000.0, "w3": 30_000.0},
                            drained_ms={"w1": 18_000.0, "w2": 12_000.0})
    assert life == {"w0": (0.0, 36_000.0), "w1": (6_000.0, 21_600.0), "w2": (9_000.0, 12_000.0),
                    "w3": (30_000.0, 36_000.0)}
    expected_s = 36.0 + 15.6 + 3.0 + 6.0
    assert replica_hours(life) == pytest.approx(expected_s / 3600.0)
    steps = replica_steps(life, {"w1": 18_000.0, "w2": 12_000.0})
    assert [(s.t_s, s.serving, s.live) for s in steps] == [
        (0.0, 1, 1), (6.0, 2, 2), (9.0, 3, 3), (12.0, 2, 2), (18.0, 1, 2), (21.6, 1, 1), (30.0, 2, 2), (36.0, 0, 0)]
    # the step function integrates to the same replica-hours
    area = sum(a.live * (b.t_s - a.t_s) for a, b in itertools.pairwise(steps))
    assert area == pytest.approx(expected_s)


# ---- the live loop's window statistics ---------------------------------------


@pytest.fixture
def ch(tmp_path):
    from kvflow.planner.clickhouse import ensure_schema, open_client

    client = open_client(data_dir=tmp_path / "ch")
    ensure_schema(client)
    yield client
    client.close()


def as_metrics(r: RequestRecord) -> RequestMetrics:
    """A replay record as the bridge would have published it (times from trace start)."""
    done = r.finish_ms if r.finish_ms is not None else r.arrival_ms
    ttft = r.first_token_ms - r.arrival_ms if r.first_token_ms is not None else 0.0
    itl = (r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1) if r.ok and r.output_tokens > 1 else 0.0
    return RequestMetrics(ts_ms=int(done), request_id=r.request_id, model="mocker", worker_id=r.worker_id,
                          isl=r.isl, osl=r.output_tokens, ttft_ms=ttft, itl_ms=itl, e2e_ms=done - r.arrival_ms,
                          cached_tokens=r.cached_tokens, ok=r.ok)


def test_window_statistics_match_the_live_clickhouse_query(ch):
    from kvflow.planner.sink import MetricsSink

    trace = [req(i, i * 300.0, isl=ISL + 64 * (i % 5), osl=1 + i % 7) for i in range(30)]
    trace.append(req(30, 2_000.0, isl=MOCKER.num_kv_blocks * MOCKER.block_size + 1))  # fails: larger than the pool
    res = simulate(trace, SimConfig(workers=2, mocker=MOCKER))
    assert sum(not r.ok for r in res.records) == 1 and any(r.output_tokens == 1 for r in res.records)
    MetricsSink(ch).write([as_metrics(r) for r in res.records])
    for t0, t1 in ((0, 4_000), (4_000, 8_000), (0, 20_000)):
        live = interval_aggregates(ch, t0, t1)
        mine = interval_aggregates_from_records(res.records, t0, t1)
        assert live.num_requests > 0
        assert (mine.num_requests, mine.num_failed) == (live.num_requests, live.num_failed)
        for name in ("mean_isl", "mean_osl", "mean_cached_tokens", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
                     "mean_itl_ms", "p50_itl_ms", "p99_itl_ms"):
            assert getattr(mine, name) == pytest.approx(getattr(live, name), rel=1e-9), name


def test_the_hook_feeds_each_finished_request_to_exactly_one_window(perf):
    trace = phases((0, 45, 2.0))
    hook = SlaPlannerHook(planner_config(), perf)
    res = Simulation(trace, SimConfig(workers=1, mocker=MOCKER), planner=hook).run()
    counted = sum(t.num_requests for t in hook.ticks)
    finished_before_last_tick = sum(r.finish_ms < hook.ticks[-1].t_s * 1000 for r in res.records)
    assert counted == finished_before_last_tick
    assert hook.ticks[0].mean_isl == ISL and hook.ticks[0].mean_osl == OSL


# ---- evaluation, report, CLI, determinism ------------------------------------


def write_azure(path: Path, trace: list[TraceRequest]) -> Path:
    """An Azure-format CSV of ``trace`` (timestamps from 2023-11-16 00:00:00)."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for r in trace:
        total_us = round(r.arrival_ms * 1000)
        s, us = divmod(total_us, 1_000_000)
        lines.append(f"2023-11-16 00:{s // 60:02d}:{s % 60:02d}.{us:06d},{r.isl},{r.osl}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def burst_csv(tmp_path_factory) -> Path:
    trace = phases((0, 40, 1.0), (40, 80, 8.0), (80, 160, 1.0))
    return write_azure(tmp_path_factory.mktemp("trace") / "burst.csv", trace)


def offline(csv: Path, out: Path, perf_profile=None, **kw):
    return run_offline(csv, workers=1, mocker_config=MOCKER, progress=False, sla_ttft_ms=1000.0, sla_itl_ms=100.0,
                       planner=planner_config(itl_ms=70.0), max_workers=6, sla_target=0.95,
                       json_path=out / "r.json", markdown_path=out / "r.md", plot_dir=out / "plots",
                       profile=perf_profile, **kw)


@pytest.fixture(scope="module")
def small_profile():
    return aggregated_mocker_profile(MOCKER, osl=OSL, isls=(256, 512, 1024), concurrencies=(1, 2, 4, 8, 16, 32),
                                     min_requests=16)


def test_report_fields_are_present_and_consistent(burst_csv, small_profile, tmp_path):
    report = offline(burst_csv, tmp_path, small_profile)
    data = json.loads((tmp_path / "r.json").read_text())
    for key in ("sla_attainment", "replica_hours", "static_peak_replica_hours", "static_mean_replica_hours",
                "static_peak_sla_attainment", "static_mean_sla_attainment", "planner"):
        assert data[key] is not None, key
    assert load_report(tmp_path / "r.json") == report
    pl = report.planner
    assert report.sla_attainment == pytest.approx(report.goodput.fraction)
    assert report.goodput.sla_itl_ms == 100.0 and pl.settings["itl_ms"] == 70.0  # SLA apart from the plan target
    runs = {r.replicas: r for r in pl.static_runs}
    peak, mean = runs[pl.static_peak_replicas], runs[pl.static_mean_replicas]
    assert (report.static_peak_replica_hours, report.static_peak_sla_attainment) == (peak.replica_hours,
                                                                                      peak.sla_attainment)
    assert (report.static_mean_replica_hours, report.static_mean_sla_attainment) == (mean.replica_hours,
                                                                                      mean.sla_attainment)
    # static peak is the smallest pool meeting the target among those simulated
    assert pl.static_peak_meets_target and peak.sla_attainment >= pl.sla_target
    assert all(r.sla_attainment < pl.sla_target for r in pl.static_runs if r.replicas < pl.static_peak_replicas)
    assert pl.static_peak_replicas - 1 in runs or pl.static_peak_replicas == 1
    assert pl.static_mean_replicas == math.ceil(pl.planner_mean_replicas)
    assert pl.planner_max_replicas == max(s.live for s in pl.replicas) >= 2
    # a static pool is live the whole run: replica-hours grow with its size
    per_replica = [r.replica_hours / r.replicas for r in pl.static_runs]
    assert max(per_replica) == pytest.approx(min(per_replica), rel=0.05)
    area_h = sum(a.live * (b.t_s - a.t_s) for a, b in itertools.pairwise(pl.replicas)) / 3600
    assert report.replica_hours == pytest.approx(area_h)
    assert pl.replica_hours_vs_static_peak == pytest.approx(report.replica_hours / report.static_peak_replica_hours)
    assert len(pl.ticks) >= 15 and pl.ticks[0].t_s == 10.0
    assert (tmp_path / "plots" / "planner.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| static peak |" in (tmp_path / "r.md").read_text()


def test_same_inputs_give_the_same_report(burst_csv, small_profile, tmp_path):
    def run(name: str) -> dict:
        offline(burst_csv, tmp_path / name, small_profile, seed=3)
        data = json.loads((tmp_path / name / "r.json").read_text())
        data.pop("wall_time_s")
        data["options"].pop("profile_s")
        return data

    assert run("a") == run("b")


def test_smallest_static_pool_bisects_to_the_first_size_meeting_the_target(burst_csv):
    trace = read_trace(burst_csv)
    n, ok, runs = smallest_static_pool(trace, SimConfig(mocker=MOCKER), 1000.0, 100.0, 0.95, 6)
    assert ok and runs[n].sla_attainment >= 0.95 and runs[n - 1].sla_attainment < 0.95
    n_none, ok_none, _ = smallest_static_pool(trace, SimConfig(mocker=MOCKER), 1.0, 1.0, 0.99, 3)
    assert (n_none, ok_none) == (3, False)  # a 1 ms TTFT is out of reach: capped and flagged


def test_cli_runs_the_planner_and_the_static_baselines(burst_csv, tmp_path):
    from kvflow.cli import app

    out = tmp_path / "cli.json"
    result = CliRunner().invoke(app, [
        "replay", str(burst_csv), "--mode", "offline", "--planner", "sla", "--ttft-ms", "1000", "--itl-ms", "100",
        "--predictor", "kalman", "--adjustment-interval-s", "10", "--min-workers", "1", "--max-workers", "4",
        "--workers", "1", "--profile-kind", "phases", "--speedup-ratio", "0.1", "--sla-target", "0.9",
        "--itl-statistic", "p99", "--correction-smoothing", "0.5",
        "--json", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["planner"]["settings"]["predictor"] == "kalman"
    assert data["planner"]["settings"]["adjustment_interval_s"] == 10.0
    assert data["planner"]["settings"]["speedup_ratio"] == 0.1 and data["planner"]["settings"]["profile"] == "phases"
    assert data["planner"]["settings"]["itl_statistic"] == "p99"
    assert data["planner"]["settings"]["ttft_statistic"] == "mean"
    assert data["planner"]["settings"]["correction_smoothing"] == 0.5
    assert 0.0 <= data["sla_attainment"] <= 1.0 and data["static_peak_replica_hours"] > 0
    assert "static mean" in result.output
    bad = CliRunner().invoke(app, ["replay", str(burst_csv), "--planner", "sla", "--workers", "8",
                                   "--max-workers", "4"])
    assert bad.exit_code != 0 and "starting pool" in bad.output
    bad = CliRunner().invoke(app, ["replay", str(burst_csv), "--planner", "sla", "--planner-itl-statistic", "p95"])
    assert bad.exit_code != 0 and "itl_statistic" in bad.output


def test_osl_family_sizes_short_outputs_by_their_own_profile():
    """A replica's capacity depends on the traffic's mean OSL (one prefill per request interrupts decode):
    profiles at several OSLs size short-output traffic by the short-OSL profile, not by one taken at a long
    OSL, and the p99 grids are never below the mean ones."""
    kw = dict(isls=(256, 512, 1024), concurrencies=(1, 2, 4, 8, 16), min_requests=16)
    short, long_ = (aggregated_mocker_profile(MOCKER, osl=o, **kw) for o in (8.0, 64.0))
    for p in (short, long_):
        for mean_row, p99_row in zip(p.decode.itl_ms, p.decode.itl_p99_ms):
            assert all(b >= a for a, b in zip(mean_row, p99_row) if a is not None)
    family = PerfFamily.from_profiles([short, long_], itl_statistic="p99")
    cfg = planner_config(itl_ms=70.0)

    def need(perf, osl: float) -> float:
        return pool_needs(initial_state(cfg, perf), Prediction(20.0, ISL, osl, 0.0))[WorkerRole.aggregated][0]

    by_short = need(PerfModel.from_profile(short, itl_statistic="p99"), 8.0)
    by_long = need(PerfModel.from_profile(long_, itl_statistic="p99"), 8.0)
    assert need(family, 8.0) == pytest.approx(by_short)
    assert abs(by_short - by_long) > 0.2 * by_short  # one fixed-OSL profile misjudges short outputs
    assert need(family, 64.0) == pytest.approx(need(PerfModel.from_profile(long_, itl_statistic="p99"), 64.0))


def test_replay_and_the_live_planner_plan_with_the_osl_family(burst_csv, tmp_path):
    """`kvflow replay --planner sla --profile-kind family` sizes with aggregated profiles at several
    mean OSLs; `kvflow profile --osl N` writes such profiles, and `--profile` given several of them
    makes the live planner loop size with their family."""
    from kvflow.cli import app
    from kvflow.planner.loop import PlannerLoop, load_profile
    from kvflow.settings import Settings
    from kvflow.streams.catalog import Catalog

    out = tmp_path / "family.json"
    result = CliRunner().invoke(app, [
        "replay", str(burst_csv), "--mode", "offline", "--planner", "sla", "--ttft-ms", "1000", "--itl-ms", "100",
        "--adjustment-interval-s", "10", "--max-workers", "4", "--workers", "1", "--profile-kind", "family",
        "--speedup-ratio", "0.1", "--sla-target", "0.9", "--itl-statistic", "p99", "--json", str(out),
        "--no-progress"])
    assert result.exit_code == 0, result.output
    settings = json.loads(out.read_text())["planner"]["settings"]
    assert settings["profile"] == "family" and settings["profile_osl"] == [16.0, 32.0, 64.0, 128.0, 256.0, 512.0]

    paths = []
    for osl in (16, 256):
        paths.append(tmp_path / f"agg{osl}.json")
        made = CliRunner().invoke(app, ["profile", "--out", str(paths[-1]), "--osl", str(osl), "--isl", "256,1024",
                                        "--concurrency", "1,4,16", "--speedup-ratio", "0.1", "--no-plot"])
        assert made.exit_code == 0, made.output
    refused = CliRunner().invoke(app, ["profile", "--out", str(tmp_path / "x.json"), "--engine", "hf",
                                       "--osl", "16"])
    assert refused.exit_code != 0 and "--osl profiles the mocker only" in refused.output
    profiles = load_profile(paths)
    assert [p.engine_config["osl"] for p in profiles] == [16.0, 256.0]
    config = PlannerConfig(mode="aggregated", itl_statistic="p99")

    async def perf_of_loop(profile):  # the loop's producer is made (not started) inside an event loop
        loop = PlannerLoop(Settings(bootstrap_servers="127.0.0.1:9"), Catalog("t"), None, config, profile, dict)
        return loop.state.perf

    family = asyncio.run(perf_of_loop(profiles))
    assert isinstance(family, PerfFamily)
    short, long_ = family.at_osl(16), family.at_osl(256)
    # short outputs: far fewer output tokens/s per replica within the same ITL (one prefill per request)
    assert short.decode.best(1024, 100).throughput_tokens_per_s < long_.decode.best(1024, 100).throughput_tokens_per_s
    assert isinstance(asyncio.run(perf_of_loop(load_profile([paths[0]]))), PerfModel)
