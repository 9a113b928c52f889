"""Shadow mode: the planner of a running deployment publishes its decisions marked
advisory on the scaling topic and scales nothing (what `kvflow up --planner sla
--planner-mode shadow` runs), on the real embedded broker and chDB."""

from __future__ import annotations

from deployment import steady
from typer.testing import CliRunner

from kvflow.cli import app as cli_app
from kvflow.planner.connectors import read_scaling_commands
from kvflow.planner.core import PlannerConfig
from kvflow.planner.loop import load_profile
from kvflow.schemas import WorkerRole
from kvflow.supervisor import Supervisor, WorkerSpec

AGG = WorkerRole.aggregated


async def test_shadow_planner_publishes_decisions_and_scales_nothing(kafka, tmp_path, waiter):
    settings, catalog = kafka
    sup = Supervisor(steady(settings),
                     WorkerSpec(engine="mocker", model="mock-model", extra_args=["--speedup-ratio=20"]), bridge=False)
    await sup.start()
    try:
        for _ in range(2):
            await sup.start_worker(AGG)
        await sup.wait_workers_ready(2, timeout_s=60)
        workers = set(sup.children)
        # No traffic: the planner wants its minimum (1) where 2 run, after one interval below.
        config = PlannerConfig(adjustment_interval_s=1.0, mode="aggregated", min_aggregated_replicas=1, max_gpus=4,
                               scale_down_hold_intervals=1)
        await sup.start_planner(config, load_profile(None, "mocker", speedup_ratio=20), data_dir=tmp_path / "chdb",
                                shadow=True)
        assert sup.planner.connector_service is None  # nothing to act on the decisions

        # two ticks' decisions (the second repeats the first: nothing acted on it)
        await waiter(lambda: sup.planner.loop.num_ticks >= 2 and len(sup.planner.loop.reports) >= 2, timeout_s=60)
        commands = await read_scaling_commands(settings, catalog)
        assert all(c.shadow and c.pool == AGG for c in commands)
        assert [(c.current_replicas, c.target_replicas) for c in commands[:2]] == [(2, 1), (2, 1)]
        assert sup.replicas(AGG) == 2 and set(sup.children) == workers  # nothing scaled, nothing drained
    finally:
        await sup.stop()


def test_planner_mode_must_be_active_or_shadow():
    result = CliRunner().invoke(cli_app, ["up", "--planner", "sla", "--planner-mode", "dry"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "--planner-mode must be active or shadow" in result.output
