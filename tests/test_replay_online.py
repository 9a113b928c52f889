"""Online replay through a live deployment on the real embedded broker agrees
with the offline simulation of the same slice and policy."""

from pathlib import Path

import pytest

from kvflow.replay import run_offline, run_online_async
from kvflow.schemas import WorkerRole
from kvflow.supervisor import Supervisor, WorkerSpec
from deployment import steady

pytestmark = pytest.mark.slow
TRACE = Path(__file__).resolve().parents[1] / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"
MODEL = "mocker-replay"


async def test_online_replay_matches_offline_hit_rate(kafka):
    settings, catalog = kafka
    settings = settings.model_copy(update={"routing_policy": "round_robin"})
    sup = Supervisor(steady(settings), WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "4"]),
                     bridge=False)
    await sup.start()
    try:
        for _ in range(4):
            await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(4, timeout_s=60)
        online = await run_online_async(TRACE, settings, model=MODEL, limit=120, speedup=10.0, progress=False,
                                        timeout_s=120)
    finally:
        await sup.stop()
    from kvflow.workers.engines.mocker_core import MockerConfig

    offline = run_offline(TRACE, workers=4, policy="round_robin", limit=120, speedup=10.0, progress=False,
                          mocker_config=MockerConfig(speedup_ratio=4.0))
    assert online.completed == online.requests == 120 and online.failed == 0
    assert online.policy == "round_robin"
    assert offline.prefix_hit_rate > 0.01
    assert abs(online.prefix_hit_rate - offline.prefix_hit_rate) <= 0.1 * offline.prefix_hit_rate
