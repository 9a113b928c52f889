"""Profiling a real engine: `kvflow profile --engine hf` writes what the planner reads.

Runs the command on the default model (SmolLM2-135M, hf engine on the CPU)
with a 2x2 grid, then loads the file the way the planner does
(:func:`kvflow.planner.loop.load_profile`, :class:`PerfModel`) and asks it
for operating points. The sweep's measuring rules are checked on the mocker
engine run live (wall clock, no weights).
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvflow.cli import app
from kvflow.planner.engine_sweep import SweepConfig, decode_point, prefill_point, sweep_engine
from kvflow.planner.interpolation import PerfModel
from kvflow.planner.loop import load_profile
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig


@pytest.mark.slow
def test_planner_loads_the_hf_profile_the_command_writes(tmp_path):
    out = tmp_path / "hf.json"
    result = CliRunner().invoke(app, ["profile", "--engine", "hf", "--out", str(out), "--isl", "32,64",
                                      "--concurrency", "1,2", "--decode-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf.png").stat().st_size > 0
    profile = load_profile(out)
    assert (profile.engine, profile.model) == ("hf", "SmolLM2-135M-Instruct")
    assert profile.prefill.isl == [32, 64] and profile.decode.concurrency == [1, 2]
    cells = [v for grid in (profile.prefill.ttft_ms, profile.decode.itl_ms) for row in grid for v in row]
    assert all(v is not None and v > 0 for v in cells)
    model = PerfModel.from_profile(profile)
    loose = model.decode.best(48, latency_target_ms=1e6)  # any point meets it: the best throughput wins
    assert loose.meets_target and loose.throughput_tokens_per_s > 0
    assert model.prefill.latency_at_throughput(48, 1.0) > 0


async def test_live_sweep_of_the_mocker_measures_every_point():
    engine = MockerEngine(MockerConfig(speedup_ratio=20.0, enable_prefix_caching=False), tokenizer="bytes")
    await engine.start()
    try:
        config = SweepConfig(decode_tokens=4, token_range=(1, 200))
        ttft, thr = await prefill_point(engine, [[7] * 64, [8] * 64])
        assert ttft > 0 and thr > 0
        itl, dthr, usage = await decode_point(engine, [[7] * 64, [8] * 64], config)
        assert itl > 0 and dthr > 0 and 0 < usage <= 1
        profile = await sweep_engine(engine, [32, 128], [1, 4], config=config, model="m")
    finally:
        await engine.stop()
    assert profile.engine == "mocker" and profile.engine_config["decode_tokens"] == 4
    assert all(v is not None for row in profile.decode.itl_ms for v in row)
    assert all(v is not None for row in profile.prefill.throughput_tokens_per_s for v in row)
