"""The planner's reaction to a x4 step burst in the simulator (bench/planner_eval.py's
configuration): added capacity serves within one worker start-up time + 5 s of the
burst's start, and only with the fast reactive path."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from kvflow.planner.interpolation import PerfModel
from kvflow.replay.planner_eval import aggregated_mocker_profile, run_with_planner
from kvflow.replay.simulator import SimConfig
from kvflow.replay.stress import StressSpec, burst_window_s, generate
from kvflow.replay.traces import TraceRequest
from kvflow.workers.engines.mocker_core import MockerConfig

_spec = importlib.util.spec_from_file_location(
    "planner_eval_bench", Path(__file__).resolve().parents[1] / "bench" / "planner_eval.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MOCKER = MockerConfig(speedup_ratio=0.25)
SPEC = StressSpec(duration_s=150.0, base_rate_per_s=3.0, burst_start_s=60.0)
STARTUP_S = 10.0


@pytest.fixture(scope="module")
def perf() -> PerfModel:
    return PerfModel.from_profile(aggregated_mocker_profile(
        MOCKER, osl=256.0, isls=(256, 512, 1024, 2048, 4096), concurrencies=(1, 4, 16, 64), min_requests=16))


def first_ready_after(run, start_s: float) -> float | None:
    starts = [t for t in run.hook.started_ms.values() if t >= start_s * 1000]
    return (min(starts) / 1000 + STARTUP_S) if starts else None


@pytest.mark.parametrize("fast", [True, False])
def test_step_burst_reaction(perf, fast):
    reqs = generate("step_burst", SPEC, seed=0)
    trace = [TraceRequest(request_id=f"r{i}", index=i, arrival_ms=r.arrival_s * 1000, isl=r.isl, osl=r.osl)
             for i, r in enumerate(reqs)]
    config = replace(bench.default_planner_config(32, STARTUP_S), adjustment_interval_s=30.0)
    run = run_with_planner(trace, SimConfig(workers=2, policy="round_robin", mocker=MOCKER,
                                            worker_startup_ms=STARTUP_S * 1000), config, perf,
                           fast_interval_s=1.0 if fast else None)
    start, _ = burst_window_s(SPEC, seed=0)
    ready = first_ready_after(run, start)
    assert ready is not None
    if fast:
        assert ready - start <= STARTUP_S + 5.0
        assert any(start * 1000 <= t <= (start + 5) * 1000 for t in run.hook.reactive_ms)
    else:  # the interval path alone waits for the next tick (90 s)
        assert ready - start > STARTUP_S + 5.0 and not run.hook.reactive_ms
