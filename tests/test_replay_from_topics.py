"""`kvflow replay --from-topics`: a live run's requests and decisions, read back from its topics
(real embedded broker, a live KV-routing router, two mocker workers), replayed offline with
another policy and compared with what was recorded."""

import asyncio
import json
import os
import sys

import pytest

from kvflow.replay.from_log import read_recorded, recorded_report, write_trace
from kvflow.replay.traces import read_trace
from kvflow.schemas import SamplingParams, now_ms
from kvflow.workers.engines.mocker_core import MockerConfig

from deployment import in_process_cluster

MODEL = "mock-replay"
GROUPS, PER_GROUP = 4, 6


@pytest.fixture
async def recorded_window(kafka, waiter):
    """Serve GROUPS x PER_GROUP requests (each group shares a long prefix) through a live kv router;
    yields ``(settings, catalog, since_ms, until_ms)``."""
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=50.0, block_size=16, num_kv_blocks=1024)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker, policy="kv") as parts:
        router, workers, client = parts
        since = now_ms()
        tokenizer = workers[0].tokenizer
        for i in range(PER_GROUP):  # waves: one request of each group at a time
            # Tokenized by the producer, as the bridge does: the router hashes the prompt's blocks.
            finals = await asyncio.gather(*(client.complete(client.new_request(
                MODEL, token_ids=tokenizer.encode_prompt(f"group {g} shared system prompt. " * 10 + f"question {i}"),
                sampling=SamplingParams(max_tokens=4))) for g in range(GROUPS)))
            assert all(f.error is None for f in finals)
        until = now_ms() + 1
    yield settings, catalog, since, until


async def test_recorded_run_reads_back_whole(recorded_window, tmp_path):
    settings, catalog, since, until = recorded_window
    run = await read_recorded(settings, since, until, catalog)
    assert len(run.requests) == GROUPS * PER_GROUP
    assert set(run.decisions) == set(run.finals) == {r.request_id for r in run.requests}
    assert run.geometry() == (16, 1024)
    report = recorded_report(run)
    assert report.completed == GROUPS * PER_GROUP and report.prefix_hit_rate > 0
    assert report.policy == "kv"
    # The rebuilt trace holds every request, prompts as the token ids the workers saw.
    write_trace(run, tmp_path / "t.jsonl")
    trace = read_trace(tmp_path / "t.jsonl")
    assert [r.request_id for r in trace.requests] == [r.request_id for r in run.requests]
    assert [r.isl for r in trace.requests] == [run.finals[r.request_id].usage.prompt_tokens for r in run.requests]


async def kvflow(*args: str) -> str:
    """Run the ``kvflow`` command; its stdout."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvflow", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    return stdout.decode()


async def replay(settings, since: int, until: int, policy: str, out) -> dict:
    scratch = out / "tmp"
    scratch.mkdir(exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow", "replay", "--from-topics", "--since", str(since), "--until", str(until),
        "--plots", str(out / policy),
        "--policy", policy, "--speedup-ratio", "50", "--no-progress", "--json", str(out / f"{policy}.json"),
        "--recorded-json", str(out / "recorded.json"), "--bootstrap-servers", settings.bootstrap_servers,
        "--namespace", settings.namespace, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch)})
    stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert "recorded" in stdout.decode()
    # The trace rebuilt from the topics was not asked to be kept: nothing of it stays behind.
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("kvflow-replay-")]
    return json.loads((out / f"{policy}.json").read_text())


async def test_replay_from_topics_with_kv_and_round_robin(recorded_window, tmp_path):
    settings, catalog, since, until = recorded_window
    kv = await replay(settings, since, until, "kv", tmp_path)
    rr = await replay(settings, since, until, "round_robin", tmp_path)
    recorded = json.loads((tmp_path / "recorded.json").read_text())
    assert kv["requests"] == rr["requests"] == recorded["requests"] == GROUPS * PER_GROUP
    assert kv["workers"] == rr["workers"] == 2  # the recorded decisions routed to two workers
    assert kv["policy"] == "kv" and rr["policy"] == "round_robin"
    # Both replays delay records by the broker hop measured on the recording.
    hop = (await read_recorded(settings, since, until, catalog)).hop_ms()
    assert kv["options"]["hop_ms"] == rr["options"]["hop_ms"] == hop >= 0
    # Round-robin scatters each group's prefix over both workers: it hits less than kv routing.
    assert kv["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert (tmp_path / "kv" / "compare_cdf.png").stat().st_size > 0
    assert (tmp_path / "kv" / "compare_load.png").stat().st_size > 0
    table = await kvflow("replay", "compare", str(tmp_path / "recorded.json"), str(tmp_path / "kv.json"),
                         str(tmp_path / "round_robin.json"), "--plots", str(tmp_path / "all"))
    assert "prefix hit rate" in table and (tmp_path / "all" / "compare_cdf.png").exists()
    print(f"hit rate: recorded {recorded['prefix_hit_rate']:.4f}, kv replay {kv['prefix_hit_rate']:.4f}, "
          f"round-robin replay {rr['prefix_hit_rate']:.4f}")
