"""NVIDIA AIPerf against kvflow: the offline tokenizer cache, the trace slice,
the ``kvflow aiperf`` command, and a real ``aiperf profile`` run replaying a
Mooncake slice against a mocker deployment on the embedded broker.

The live test needs the ``aiperf`` program (``$KVFLOW_AIPERF``, ``aiperf`` on
``PATH`` or ``/tmp/aiperfvenv/bin/aiperf``; see docs/aiperf.md) and skips
without it.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from kvflow.replay.aiperf import aiperf_command, aiperf_env, find_aiperf, make_hf_cache, write_trace_slice
from kvflow.replay.aiperf_cli import aiperf as aiperf_cmd
from kvflow.supervisor import WorkerSpec
from deployment import running_deployment

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"
MODEL = "SmolLM2-135M-Instruct"


def _default_model_dir() -> Path:
    from kvflow.models.resolve import ModelNotFoundError, resolve_model

    try:
        return resolve_model(MODEL).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available: {exc}")


def _fake_model(path: Path, vocab: str = "a b c") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps({"vocab": vocab}))
    (path / "tokenizer_config.json").write_text("{}")
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"\0" * 1024)
    return path


# ---- the Hugging Face cache layout ---------------------------------------------------------


def test_make_hf_cache_lays_out_a_hub_snapshot(tmp_path):
    model = _fake_model(tmp_path / "model")
    home, repo = make_hf_cache(model, tmp_path / "hf", "Org/Name")
    assert (home, repo) == (tmp_path / "hf", "Org/Name")
    entry = home / "hub" / "models--Org--Name"
    rev = (entry / "refs" / "main").read_text()
    assert re.fullmatch(r"[0-9a-f]{40}", rev)
    snapshot = entry / "snapshots" / rev
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert (snapshot / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert [p.name for p in (entry / "snapshots").iterdir()] == [rev]  # no temporary directory left

    # same files -> same snapshot; a changed tokenizer -> a new snapshot that refs/main points at
    assert make_hf_cache(model, tmp_path / "hf", "Org/Name") == (home, repo)
    assert (entry / "refs" / "main").read_text() == rev
    (model / "tokenizer.json").write_text(json.dumps({"vocab": "x y"}))
    make_hf_cache(model, tmp_path / "hf", "Org/Name")
    rev2 = (entry / "refs" / "main").read_text()
    assert rev2 != rev and json.loads((entry / "snapshots" / rev2 / "tokenizer.json").read_text()) == {"vocab": "x y"}


def test_make_hf_cache_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="ORG/NAME"):
        make_hf_cache(_fake_model(tmp_path / "m"), tmp_path / "hf", "no-slash")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        make_hf_cache(empty, tmp_path / "hf")


def test_hf_cache_resolves_offline_by_repo_id(tmp_path):
    """The layout is what huggingface_hub and transformers read offline: the real
    SmolLM2 tokenizer loads by Hub id from the cache and encodes like the original."""
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoTokenizer

    model_dir = _default_model_dir()
    home, repo = make_hf_cache(model_dir, tmp_path / "hf")
    cached = try_to_load_from_cache(repo, "tokenizer.json", cache_dir=home / "hub")
    assert isinstance(cached, str) and Path(cached).read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(repo, cache_dir=home / "hub", local_files_only=True)
    ref = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = "Shall I compare thee to a summer's day?"
    assert tok.encode(text) == ref.encode(text) and len(tok.encode(text)) > 5


# ---- trace slice, command line ----------------------------------------------------------------


def test_write_trace_slice_keeps_lines_verbatim(tmp_path):
    source = MOONCAKE.read_text().splitlines()
    assert write_trace_slice(MOONCAKE, tmp_path / "s.jsonl", 7) == 7
    assert (tmp_path / "s.jsonl").read_text().splitlines() == source[:7]

    n = write_trace_slice(MOONCAKE, tmp_path / "short.jsonl", 5, max_input_length=5000)
    rows = [json.loads(line) for line in (tmp_path / "short.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in source if json.loads(line)["input_length"] <= 5000][:5]
    assert n == 5 and rows == expected
    with pytest.raises(ValueError):
        write_trace_slice(MOONCAKE, tmp_path / "x.jsonl", 0)


def test_kvflow_aiperf_dry_run_prints_an_offline_command(tmp_path, monkeypatch):
    _default_model_dir()
    stub = tmp_path / "bin" / "aiperf"  # never run: a dry run only prints the command
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 3\n")
    monkeypatch.setenv("KVFLOW_AIPERF", str(stub))
    app = typer.Typer()
    app.command("aiperf")(aiperf_cmd)
    app.command("other")(lambda: None)  # two commands, so typer keeps the sub-command name
    result = CliRunner().invoke(app, [
        "aiperf", str(MOONCAKE), "--limit", "3", "--url", "http://127.0.0.1:9", "--artifact-dir",
        str(tmp_path / "art"), "--hf-home", str(tmp_path / "hf"), "--dry-run", "--", "--goodput",
        "time_to_first_token:500"])
    assert result.exit_code == 0, result.output
    env_line, cmd_line = result.output.strip().split("\\\n")
    assert f"HF_HOME={tmp_path / 'hf'}" in env_line and "HF_HUB_OFFLINE=1" in env_line
    sliced = tmp_path / "art" / "mooncake_conversation_first40min.first3.jsonl"
    assert len(sliced.read_text().splitlines()) == 3
    assert cmd_line.split() == aiperf_command(
        sliced, url="http://127.0.0.1:9", model=MODEL, artifact_dir=tmp_path / "art",
        aiperf=str(stub), extra_args=["--goodput", "time_to_first_token:500"])
    assert (tmp_path / "hf" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs" / "main").is_file()


def test_aiperf_command_options():
    cmd = aiperf_command("t.jsonl", url="http://h:1", model="m", artifact_dir="a", streaming=False,
                         server_token_count=False, server_metrics=True, endpoint_type="completions")
    assert "--streaming" not in cmd and "--use-server-token-count" not in cmd and "--no-server-metrics" not in cmd
    assert cmd[cmd.index("--endpoint-type") + 1] == "completions"
    with pytest.raises(ValueError):
        aiperf_command("t.jsonl", url="http://h:1", model="m", artifact_dir="a", endpoint_type="embeddings")


# ---- a real aiperf run against a mocker deployment -------------------------------------------

N_REQUESTS = 6


@pytest.fixture
def aiperf_exe():
    exe = find_aiperf()
    if exe is None and os.environ.get("KVFLOW_AIPERF"):
        pytest.skip(f"KVFLOW_AIPERF={os.environ['KVFLOW_AIPERF']} is not an executable")
    if exe is None:
        pytest.skip("aiperf is not installed: set KVFLOW_AIPERF, put aiperf on PATH or install it in "
                    "/tmp/aiperfvenv (python3 -m venv /tmp/aiperfvenv && /tmp/aiperfvenv/bin/pip install "
                    "aiperf==0.13.0)")
    return exe


@pytest.fixture
async def mocker_deployment(kafka):
    settings, _ = kafka
    # The mocker tokenizes bytes: a Mooncake prompt of N tokens is ~4.3 N byte tokens.
    settings = settings.model_copy(update={"max_prompt_tokens": 262144, "max_record_bytes": 1 << 20})
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "20"])
    async with running_deployment(settings, spec, workers=2) as sup:
        yield sup


async def test_request_over_one_mib_is_served_with_the_default_record_limit(kafka):
    """A ~1.3 MB request record (a long prompt) fits the default 16 MiB record
    limit end to end: bridge → requests → router (Faust producer) → queue → worker."""
    settings, _ = kafka
    settings = settings.model_copy(update={"max_prompt_tokens": 262144})
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "20"])
    async with running_deployment(settings, spec, workers=1) as sup:
        async with httpx.AsyncClient(base_url=sup.url, timeout=120) as http:
            big = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "a" * 260_000}], "max_tokens": 2})
            assert big.status_code == 200, big.text
            assert big.json()["usage"]["prompt_tokens"] > 260_000


async def test_aiperf_replays_mooncake_slice_against_mocker(mocker_deployment, aiperf_exe, tmp_path):
    trace = tmp_path / "slice.jsonl"
    assert write_trace_slice(MOONCAKE, trace, N_REQUESTS) == N_REQUESTS
    osl = [json.loads(line)["output_length"] for line in trace.read_text().splitlines()]
    home, repo = make_hf_cache(_default_model_dir(), tmp_path / "hf")
    art = tmp_path / "artifacts"
    cmd = aiperf_command(trace, url=mocker_deployment.url, model=MODEL, artifact_dir=art, tokenizer=repo,
                         aiperf=aiperf_exe)
    # Async subprocess: the bridge under test serves from this event loop.
    proc = await asyncio.create_subprocess_exec(*cmd, env=aiperf_env(home, scratch_dir=tmp_path / "scratch"),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                cwd=tmp_path)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log[-4000:]

    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == N_REQUESTS
    assert not summary["error_summary"] and "error_request_count" not in summary, summary["error_summary"]
    assert summary["was_cancelled"] is False
    # Server-reported usage: every request produced exactly the trace's output length.
    assert summary["output_sequence_length"]["count"] == N_REQUESTS
    assert summary["output_sequence_length"]["sum"] == sum(osl) > 0
    ttft = summary["time_to_first_token"]
    assert ttft["count"] == N_REQUESTS and 0 < ttft["min"] <= ttft["max"] < summary["request_latency"]["max"]
    assert summary["inter_token_latency"]["count"] >= 1 and summary["inter_token_latency"]["avg"] > 0
    assert summary["input_sequence_length"]["min"] > 1000  # byte tokens of multi-thousand-token prompts

    rows = {r[0]: r for r in csv.reader((art / "profile_export_aiperf.csv").read_text().splitlines()) if r}
    assert float(rows["Time to First Token (ms)"][1]) == pytest.approx(ttft["avg"], abs=0.01)
    assert float(rows["Request Count"][1]) == N_REQUESTS
    records = [json.loads(line) for line in (art / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == N_REQUESTS and all(r.get("error") is None for r in records)
    assert sorted(r["metrics"]["output_sequence_length"]["value"] for r in records) == sorted(osl)
    assert all(r["metrics"]["time_to_first_token"]["value"] > 0 for r in records)


async def test_request_over_the_kafka_record_limit_is_413_not_503(mocker_deployment):
    """A prompt under ``max_prompt_tokens`` whose request record still exceeds the
    producer's record limit (``max_record_bytes``, 1 MiB in this deployment)
    is the client's 413, not a retryable broker outage."""
    prompt = "a" * 260_000  # 260k byte tokens: ~1.3 MB as a JSON record
    async with httpx.AsyncClient(base_url=mocker_deployment.url, timeout=60) as http:
        big = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True})
        assert big.status_code == 413, big.text
        assert big.json()["error"]["code"] == "payload_too_large" and "Retry-After" not in big.headers
        ok = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
