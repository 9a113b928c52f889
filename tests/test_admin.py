"""Engine admin through the control topic: sleep, wake and clear-KV on mocker workers.

Real embedded broker, the Faust router (kv policy) and two in-process mocker
workers (``w0``, ``w1``); commands go out as `kvflow admin` sends them
(:func:`kvflow.streams.admin.send_admin_command`, once through the CLI
itself) and the test waits on the worker's answer record, the router's
routing table and its KV index.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from deployment import in_process_cluster

from kvflow.schemas import (
    AdminAction,
    AdminCommand,
    AdminCommandApplied,
    SamplingParams,
    WorkerStatus,
    decode,
    encode,
    now_ms,
)
from kvflow.schemas.control import ControlRecord
from kvflow.streams.admin import AdminTimeout, send_admin_command
from kvflow.workers.engines.mocker_core import MockerConfig

MODEL = "mock-model"
MOCKER = MockerConfig(speedup_ratio=20.0, block_size=16, num_kv_blocks=1024)


def prompt(seed: int, n: int = 160) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 3 for i in range(n)]


@pytest.fixture
async def cluster(kafka, waiter):
    settings, catalog = kafka
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=MOCKER,
                                  policy="kv") as (router, workers, client):
        yield settings, catalog, router, {w.config.worker_id: w for w in workers}, client


def blocks(router, worker_id: str) -> int:
    """Blocks the router's KV index holds for ``worker_id`` (0 before its first KV event)."""
    index = router.table.kv_index
    return 0 if index is None else index.num_blocks(worker_id)


async def serve(client, seed: int, max_tokens: int = 4):
    request = client.new_request(MODEL, token_ids=prompt(seed), sampling=SamplingParams(max_tokens=max_tokens))
    final = await client.complete(request)
    assert final.error is None
    return final


def test_control_records_round_trip():
    command = AdminCommand(command_id="c1", worker_id="w0", action=AdminAction.sleep, level=2, ts_ms=now_ms())
    assert decode(ControlRecord, encode(command)) == command
    answer = AdminCommandApplied(command_id="c1", worker_id="w0", action="clear_kv", ok=False, detail="x", ts_ms=1)
    assert decode(ControlRecord, encode(answer)) == answer
    with pytest.raises(ValueError):
        AdminCommand(command_id="c1", worker_id="w0", action="sleep", level=3, ts_ms=1)


async def test_clear_kv_drops_the_workers_blocks_from_the_router_index(cluster, waiter):
    settings, catalog, router, workers, client = cluster
    final = await serve(client, 1)
    wid = final.worker_id
    await waiter(lambda: blocks(router, wid) >= 10)
    answer = await send_admin_command(settings, wid, AdminAction.clear_kv, timeout_s=30, catalog=catalog)
    assert answer.ok and answer.worker_id == wid and "dropped" in answer.detail
    assert workers[wid].engine.core.pool.num_cached_blocks == 0
    await waiter(lambda: blocks(router, wid) == 0)
    # The worker still serves, and caches again.
    again = await serve(client, 2)
    await waiter(lambda: blocks(router, again.worker_id) >= 10)


async def test_clear_kv_is_refused_while_a_request_holds_blocks(cluster, waiter, monkeypatch):
    settings, catalog, router, workers, client = cluster
    # Hold every engine step until the refusal is in: the request cannot finish first.
    gate = asyncio.Event()

    async def gated_sleep(seconds: float) -> None:
        await gate.wait()

    for w in workers.values():
        monkeypatch.setattr(w.engine, "_sleep", gated_sleep)  # the mocker's injectable step clock
    slow = client.new_request(MODEL, token_ids=prompt(3), sampling=SamplingParams(max_tokens=8))
    done = asyncio.ensure_future(client.complete(slow))
    busy = await waiter(lambda: next((w for w in workers.values() if w.engine.core.has_work()), None))
    answer = await send_admin_command(settings, busy.config.worker_id, "clear_kv", timeout_s=30, catalog=catalog)
    assert not answer.ok and "refused" in answer.detail
    assert busy.engine.core.has_work()  # nothing was dropped: the request still holds its blocks
    gate.set()
    assert (await done).error is None


async def test_a_sleeping_worker_is_unroutable_until_woken(cluster, waiter):
    settings, catalog, router, workers, client = cluster
    first = await serve(client, 10)
    asleep, awake = first.worker_id, ({"w0", "w1"} - {first.worker_id}).pop()
    await waiter(lambda: blocks(router, asleep) > 0)

    answer = await send_admin_command(settings, asleep, AdminAction.sleep, timeout_s=60, catalog=catalog)
    assert answer.ok, answer.detail
    assert workers[asleep].status is WorkerStatus.sleeping and workers[asleep].engine.asleep
    await waiter(lambda: router.table.workers[asleep].status is WorkerStatus.sleeping)
    await waiter(lambda: blocks(router, asleep) == 0)  # AllBlocksCleared reached the index
    # Concurrent requests, one with the prompt the sleeper had cached: the kv
    # policy would spread them by load and overlap, yet none goes there.
    finals = await asyncio.gather(*(serve(client, seed) for seed in (10, 21, 22, 23, 24, 25)))
    assert [f.worker_id for f in finals] == [awake] * 6
    again = await send_admin_command(settings, asleep, "sleep", timeout_s=30, catalog=catalog)
    assert again.ok and again.detail == "already sleeping"

    answer = await send_admin_command(settings, asleep, AdminAction.wake, timeout_s=30, catalog=catalog)
    assert answer.ok and not workers[asleep].engine.asleep
    await waiter(lambda: router.table.workers[asleep].status is WorkerStatus.serving)
    finals = await asyncio.gather(*(serve(client, 30 + seed, 40) for seed in range(8)))
    assert {f.worker_id for f in finals} == {"w0", "w1"}


async def test_admin_cli_answers_and_unknown_workers_time_out(cluster, waiter):
    settings, catalog, router, workers, client = cluster
    await serve(client, 40)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow", "admin", "clear-kv", "w1", "--bootstrap-servers",
        settings.bootstrap_servers, "--namespace", settings.namespace, "--timeout-s", "60",
        env={**os.environ, "KVFLOW_EMBEDDED_BROKER": "1"},  # Tansu: no idempotent producer
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("w1: clear_kv done")
    await waiter(lambda: blocks(router, "w1") == 0)
    with pytest.raises(AdminTimeout):
        await send_admin_command(settings, "nobody", "wake", timeout_s=1.5, catalog=catalog)
