"""Scale to zero, live: the planner of a running deployment drains its last idle worker;
a request arriving with no worker is held by the router (not shed, not lost) while the
planner's fast path starts one, and is served by it. Real embedded broker, chDB, router
and mocker worker processes (what `kvflow up --planner sla --min-workers 0 --shed-mode
queue --shed-cold-start-hold-s 60` runs)."""

from __future__ import annotations

from typer.testing import CliRunner

from deployment import steady

from kvflow.cli import app as cli_app
from kvflow.planner.connectors import read_scaling_commands
from kvflow.planner.core import PlannerConfig
from kvflow.planner.loop import load_profile
from kvflow.schemas import SamplingParams, WorkerRole
from kvflow.streams.client import KvflowClient
from kvflow.supervisor import Supervisor, WorkerSpec

AGG = WorkerRole.aggregated
MODEL = "mock-model"


async def test_an_idle_pool_scales_to_zero_and_a_held_request_starts_a_worker(kafka, tmp_path, waiter):
    settings, catalog = kafka
    settings = settings.model_copy(update={"shed_mode": "queue", "shed_cold_start_hold_s": 60.0})
    sup = Supervisor(steady(settings), WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio=20"]),
                     bridge=False)
    await sup.start()
    client = KvflowClient(settings, catalog, timeout_s=120)
    try:
        await sup.start_worker(AGG)
        await sup.wait_workers_ready(1, timeout_s=60)
        first = set(sup.children)
        config = PlannerConfig(adjustment_interval_s=1.0, mode="aggregated", min_aggregated_replicas=0, max_gpus=2,
                               scale_down_hold_intervals=1, worker_startup_s=2.0)
        await sup.start_planner(config, load_profile(None, "mocker", speedup_ratio=20), data_dir=tmp_path / "chdb")
        # no traffic: the planner drains the last worker, and the router forgets it
        await waiter(lambda: sup.replicas(AGG) == 0 and not sup.router.table.workers, timeout_s=60)

        await client.start()
        final = await client.complete(client.new_request(MODEL, prompt="after the idle spell",
                                                         sampling=SamplingParams(max_tokens=8)))
        assert final.error is None and final.usage.completion_tokens == 8
        assert final.worker_id not in first  # served by the worker the cold start brought up
        assert sup.router.core.counters["cold_held"] == 1 and sup.router.core.counters["rejected"] == 0

        commands = await read_scaling_commands(settings, catalog)
        moves = [(c.current_replicas, c.target_replicas) for c in commands if c.pool == AGG]
        assert (1, 0) in moves and (0, 1) in moves
        cold = next(c for c in commands if (c.current_replicas, c.target_replicas) == (0, 1))
        assert "cold start" in cold.reason and not cold.shadow
    finally:
        await client.stop()
        await sup.stop()


def test_min_workers_zero_needs_the_router_to_hold_requests():
    result = CliRunner().invoke(cli_app, ["up", "--planner", "sla", "--min-workers", "0", "--engine", "mocker"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "--shed-cold-start-hold-s" in result.output
    result = CliRunner().invoke(cli_app, ["up", "--shed-cold-start-hold-s", "30", "--engine", "mocker"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "needs mode='queue'" in result.output
