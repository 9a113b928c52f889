"""`kvflow index --at T`: the global KV index rebuilt from the log equals the live router's index at T
(real embedded broker, a live KV-routing router and two mocker workers)."""

import asyncio
import json
import sys

import pytest

from kvflow.cli_options import parse_time_ms
from kvflow.router.history import index_at
from kvflow.schemas import SamplingParams, now_ms
from kvflow.workers.engines.mocker_core import MockerConfig

from deployment import in_process_cluster

MODEL = "mock-index"


@pytest.fixture
async def cluster(kafka, waiter):
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=50.0, block_size=16, num_kv_blocks=512)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker, policy="kv") as parts:
        yield settings, catalog, *parts


async def serve_and_settle(client, router, workers, waiter, prompts: list[str]) -> None:
    """Serve ``prompts``, then wait until the router has folded every KV batch the workers published."""
    for prompt in prompts:
        final = await client.complete(client.new_request(MODEL, prompt=prompt, sampling=SamplingParams(max_tokens=3)))
        assert final.error is None

    def caught_up() -> bool:
        index = router.table.kv_index
        return index is not None and all(
            w.next_event_id == 0 or index.last_event_id(w.config.worker_id) == w.next_event_id - 1 for w in workers)
    await waiter(caught_up, timeout_s=30)


async def test_index_at_t_equals_the_live_index_at_t(cluster, waiter):
    settings, catalog, router, workers, client = cluster
    await serve_and_settle(client, router, workers, waiter, [f"first wave prompt {i} " * 12 for i in range(6)])
    at_ms = now_ms()
    live_then = router.table.kv_index.snapshot()
    await waiter(lambda: now_ms() > at_ms)  # later batches are stamped after T
    await serve_and_settle(client, router, workers, waiter, [f"second wave prompt {i} " * 12 for i in range(6)])
    live_now = router.table.kv_index.snapshot()
    assert live_now != live_then, "the second wave must change the index"

    then = await index_at(settings, at_ms, catalog)
    assert then.index.snapshot() == live_then
    assert then.skipped_later > 0
    now = await index_at(settings, now_ms(), catalog)
    assert now.index.snapshot() == live_now

    # The command prints the same counts.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow", "index", "--at", str(at_ms), "--bootstrap-servers", settings.bootstrap_servers,
        "--namespace", settings.namespace, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    printed = json.loads(out)
    assert printed["blocks"] == {w: len(v["device"]) for w, v in live_then["workers"].items()}


def test_time_formats():
    assert parse_time_ms("1700000000123") == 1700000000123
    assert parse_time_ms("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_time_ms("2023-11-14T22:13:20") == 1_700_000_000_000
    assert parse_time_ms("-5m", now_ms=1_000_000) == 700_000
    assert parse_time_ms("now", now_ms=42) == 42
