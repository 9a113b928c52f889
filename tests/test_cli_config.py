"""CLI configuration: flag > ``KVFLOW_*`` environment > Settings default for
every command, one flag name per concept (``--router`` a deprecated alias of
``--policy``), per-deployment state files found by ``--port`` or
``--state-file``, and two ``kvflow up`` side by side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

import kvflow
import kvflow.supervisor
from kvflow.cli import app
from kvflow.cli_options import join_settings, resolve_settings
from kvflow.deployments import (
    AmbiguousDeployment,
    DeploymentNotFound,
    DeploymentState,
    find_deployment,
    live_deployments,
    state_path,
    write_state,
)
from kvflow.settings import Settings
from kvflow.streams.broker import free_port

REPO = Path(kvflow.__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No KVFLOW_* variable from the caller's shell leaks in; the data dir is the test's own."""
    for name in list(os.environ):
        if name.startswith("KVFLOW_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVFLOW_DATA_DIR", str(tmp_path / "data"))


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def record(settings: Settings, port: int, pid: int | None = None, **kw) -> Path:
    """Write a state file for a deployment on ``port`` (alive: this process by default)."""
    path = state_path(settings, port)
    fields = dict(bootstrap_servers=f"127.0.0.1:{port + 1000}", embedded_broker=True, namespace=f"ns{port}",
                  url=f"http://127.0.0.1:{port}", port=port, pid=os.getpid() if pid is None else pid)
    write_state(path, DeploymentState(**{**fields, **kw}))
    return path


# --- flag > environment > default ------------------------------------------------------------------------------


def test_unset_flags_take_the_environment_and_given_flags_win(monkeypatch):
    assert resolve_settings(routing_policy=None).routing_policy == "kv"
    monkeypatch.setenv("KVFLOW_ROUTING_POLICY", "round_robin")
    monkeypatch.setenv("KVFLOW_DISAGG_PREFILL_THRESHOLD_TOKENS", "4000")
    settings = resolve_settings(routing_policy=None, disagg_prefill_threshold_tokens=None, namespace=None)
    assert settings.routing_policy == "round_robin"
    assert settings.disagg_prefill_threshold_tokens == 4000 and settings.namespace == "kvflow"
    settings = resolve_settings(routing_policy="least_loaded", disagg_prefill_threshold_tokens=0,
                                state_file=Path("/tmp/x.json"))
    assert settings.routing_policy == "least_loaded" and settings.disagg_prefill_threshold_tokens == 0
    assert settings.state_file == "/tmp/x.json"


def test_an_invalid_value_names_its_variable(monkeypatch):
    monkeypatch.setenv("KVFLOW_DISAGG_MAX_PREFILL_QUEUE_PER_WORKER", "0")
    with pytest.raises(typer.BadParameter, match="KVFLOW_DISAGG_MAX_PREFILL_QUEUE_PER_WORKER"):
        resolve_settings()


def test_non_kvflow_variables_also_come_through_settings(monkeypatch, tmp_path):
    from kvflow.replay.aiperf import find_aiperf
    from kvflow.streams.broker import broker_binary
    from kvflow.models.resolve import models_cache_dir

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    assert models_cache_dir() == tmp_path / "cache" / "models"
    tansu = tmp_path / "tansu"
    tansu.write_text("#!/bin/sh\n")
    tansu.chmod(0o755)
    monkeypatch.setenv("CALF_TANSU_BIN", str(tansu))
    assert Settings().tansu_bin == str(tansu) and broker_binary() == str(tansu)
    monkeypatch.setenv("KVFLOW_AIPERF", str(tansu))
    assert find_aiperf() == str(tansu)


class _DryRun(Exception):
    pass


class FakeSupervisor:
    """Stands in for the real one: records the settings `kvflow up` resolved, then stops the command."""

    seen: list[Settings] = []

    def __init__(self, settings, spec, *, host="127.0.0.1", port=8000, bridge=True):
        self.settings = settings

    async def start(self):
        FakeSupervisor.seen.append(self.settings)
        raise _DryRun

    async def stop(self):
        pass


@pytest.fixture
def dry_up(monkeypatch):
    """Run `kvflow up` up to the point it would start the deployment; returns the settings it would use."""
    monkeypatch.setattr(kvflow.supervisor, "Supervisor", FakeSupervisor)
    FakeSupervisor.seen.clear()

    def run(*args: str, env: dict[str, str] | None = None) -> Settings:
        FakeSupervisor.seen.clear()
        result = CliRunner().invoke(app, ["up", "--engine", "mocker", *args], env=env)
        assert isinstance(result.exception, _DryRun), result.output
        return FakeSupervisor.seen[-1]

    return run


def test_up_routes_with_the_policy_from_the_environment_unless_a_flag_says_otherwise(dry_up):
    assert dry_up().routing_policy == "kv"
    assert dry_up(env={"KVFLOW_ROUTING_POLICY": "round_robin"}).routing_policy == "round_robin"
    flagged = dry_up("--policy", "least_loaded", env={"KVFLOW_ROUTING_POLICY": "round_robin"})
    assert flagged.routing_policy == "least_loaded"
    settings = dry_up("--namespace", "flagged", env={"KVFLOW_NAMESPACE": "fromenv",
                                                     "KVFLOW_DISAGG_MAX_PREFILL_QUEUE_PER_WORKER": "5"})
    assert settings.namespace == "flagged" and settings.disagg_max_prefill_queue_per_worker == 5


def test_up_refuses_an_unknown_policy_before_starting_anything(dry_up):
    result = CliRunner().invoke(app, ["up", "--engine", "mocker"], env={"KVFLOW_ROUTING_POLICY": "fastest"})
    assert result.exit_code == 2 and "unknown routing policy 'fastest'" in result.output
    assert not FakeSupervisor.seen


def test_up_refuses_a_port_a_live_deployment_has_recorded(dry_up):
    record(Settings(), 8123, pid=os.getppid())  # another live process
    result = CliRunner().invoke(app, ["up", "--engine", "mocker", "--port", "8123", "--no-bridge"])
    assert result.exit_code == 2 and "already recorded" in result.output and "pid" in result.output
    assert not FakeSupervisor.seen
    record(Settings(), 8123, pid=dead_pid())  # stale: ignored, and the new deployment may start
    assert dry_up("--port", "8123", "--no-bridge").routing_policy == "kv"


# --- one flag name per concept ---------------------------------------------------------------------------------


def _replay(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    out = tmp_path / f"r{len(list(tmp_path.glob('r*.json')))}.json"
    result = CliRunner().invoke(app, ["replay", str(MOONCAKE), "--mode", "offline", "--workers", "2", "--limit",
                                      "20", "--no-progress", "--json", str(out), *args], env=env)
    return result, out


def test_replay_takes_policy_and_router_is_a_deprecated_alias(tmp_path, caplog):
    result, out = _replay(tmp_path, "--policy", "least_loaded")
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["policy"] == "least_loaded"
    with caplog.at_level(logging.WARNING, logger="kvflow.cli"):
        result, out = _replay(tmp_path, "--router", "random")
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["policy"] == "random"
    assert any("--router is deprecated; use --policy" in r.getMessage() for r in caplog.records)
    result, _ = _replay(tmp_path, "--router", "random", "--policy", "kv")
    assert result.exit_code == 2 and "contradicts --policy" in result.output


def test_replay_routes_like_up_would_in_the_same_environment(tmp_path):
    result, out = _replay(tmp_path, env={"KVFLOW_ROUTING_POLICY": "round_robin"})
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["policy"] == "round_robin"
    result, out = _replay(tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["policy"] == "kv"  # Settings' default, as `kvflow up`


def test_help_shows_full_option_names_in_80_columns():
    for command in ("up", "replay", "status", "explain", "produce", "planner"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert result.exit_code == 0
        lines = result.output.splitlines()
        assert max(map(len, lines)) <= 80 and "…" not in result.output
        assert "--bootstrap-servers" in result.output and "--namespace" in result.output
    up_help = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
    for name in ("--disagg-threshold-tokens", "--disagg-max-prefill-queue", "--scale-down-hold-intervals",
                 "--adjustment-interval-s", "--api-keys-file", "--policy", "--state-file", "--data-dir"):
        assert name in up_help
    assert "KVFLOW_ROUTING_POLICY; default: kv" in " ".join(up_help.split())
    replay_help = CliRunner().invoke(app, ["replay", "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
    assert "--policy" in replay_help and "--router" not in replay_help


# --- per-deployment state files ----------------------------------------------------------------------------------


def test_state_files_are_per_port_and_found_by_port():
    settings = Settings()
    a, b = record(settings, 8101), record(settings, 8102)
    assert a != b and a.parent == Path(settings.data_dir).absolute() / "deployments" and a.name == "8101.json"
    assert find_deployment(settings, port=8102).bootstrap_servers == "127.0.0.1:9102"
    assert find_deployment(settings, state_file=a).port == 8101
    with pytest.raises(DeploymentNotFound, match="port 8103"):
        find_deployment(settings, port=8103)
    with pytest.raises(AmbiguousDeployment) as err:
        find_deployment(settings)
    assert "port 8101" in str(err.value) and "port 8102" in str(err.value) and "--port" in str(err.value)


def test_a_stale_state_file_is_ignored_and_removed():
    settings = Settings()
    live, stale = record(settings, 8201), record(settings, 8202, pid=dead_pid())
    assert [s.port for _, s in live_deployments(settings.data_dir)] == [8201]
    assert live.exists() and not stale.exists()
    record(settings, 8202, pid=dead_pid())
    assert find_deployment(settings).port == 8201  # the only live one, without --port
    with pytest.raises(DeploymentNotFound):
        find_deployment(settings, port=8202)


def test_commands_join_the_deployment_port_or_state_file_choose(monkeypatch, tmp_path):
    settings = Settings()
    record(settings, 8301)
    joined = join_settings(port=8301, bootstrap_servers=None, namespace=None)
    assert (joined.bootstrap_servers, joined.namespace, joined.embedded_broker) == ("127.0.0.1:9301", "ns8301", True)
    assert join_settings(port=8301, namespace="mine").namespace == "mine"  # a given flag still wins
    assert join_settings().bootstrap_servers == "127.0.0.1:9301"  # the only one running
    with pytest.raises(typer.BadParameter, match="not both"):
        join_settings(port=8301, bootstrap_servers="kafka:9092")
    assert join_settings(bootstrap_servers="kafka:9092").bootstrap_servers == "kafka:9092"
    # KVFLOW_STATE_FILE: `kvflow up` writes there and other commands read it (the Dynamo harness sets it).
    elsewhere = tmp_path / "run" / "up.json"
    monkeypatch.setenv("KVFLOW_STATE_FILE", str(elsewhere))
    assert state_path(Settings(), 8302) == elsewhere
    record(Settings(), 8302, bootstrap_servers="127.0.0.1:7777")
    assert join_settings().bootstrap_servers == "127.0.0.1:7777"
    assert join_settings(port=8302).bootstrap_servers == "127.0.0.1:7777"
    assert join_settings(port=8301).bootstrap_servers == "127.0.0.1:9301"


def test_status_with_several_deployments_and_no_port_lists_them():
    record(Settings(), 8401)
    record(Settings(), 8402)
    result = CliRunner().invoke(app, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "2 deployments are running" in result.output
    assert "port 8401" in result.output and "port 8402" in result.output
    result = CliRunner().invoke(app, ["produce", "--port", "8499", "hi"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "no running deployment on port 8499" in result.output


# --- two `kvflow up` side by side --------------------------------------------------------------------------------


def _kvflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvflow", *args]


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT `kvflow up` (it stops its workers and broker), then kill whatever is left of its process tree."""
    try:
        import psutil

        family = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing, or the process already gone
        family = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for child in family:
        with contextlib.suppress(Exception):
            child.kill()


async def _wait_ready(proc: subprocess.Popen, state_file: Path, timeout_s: float = 240.0) -> DeploymentState:
    """Wait until `kvflow up` recorded itself and its bridge sees a live worker."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient() as http:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"kvflow up exited with {proc.returncode}")
            if state_file.exists():
                state = DeploymentState.model_validate_json(state_file.read_text())
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{state.url}/health")).status_code == 200:
                        return state
            if loop.time() > deadline:
                raise AssertionError(f"{state_file} / health not ready within {timeout_s} s")
            await asyncio.sleep(0.2)


async def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, _kvflow(*args), env=env, capture_output=True, text=True,
                                   timeout=180)


async def test_two_deployments_side_by_side(tmp_path):
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env.update(KVFLOW_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    ports = {"a": free_port(), "b": free_port()}
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: open(tmp_path / f"up-{name}.log", "w") for name in ports}  # noqa: SIM115
    try:
        # a: policy from the environment; b: a flag overriding the environment.
        envs = {"a": {**env, "KVFLOW_ROUTING_POLICY": "round_robin"},
                "b": {**env, "KVFLOW_ROUTING_POLICY": "round_robin"}}
        flags = {"a": [], "b": ["--policy", "least_loaded"]}
        for name, port in ports.items():
            procs[name] = subprocess.Popen(
                _kvflow("up", "--engine", "mocker", "--workers", "1", "--model", f"mock-{name}", "--port", str(port),
                        "--speedup-ratio", "20", *flags[name]),
                env=envs[name], cwd=tmp_path, stdout=logs[name], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        states = {name: await _wait_ready(procs[name], data_dir / "deployments" / f"{port}.json")
                  for name, port in ports.items()}
        assert states["a"].bootstrap_servers != states["b"].bootstrap_servers
        assert (states["a"].routing_policy, states["b"].routing_policy) == ("round_robin", "least_loaded")

        for name, port in ports.items():
            listed = await _run(env, "status", "--port", str(port), "--json")
            assert listed.returncode == 0, listed.stderr
            rows = json.loads(listed.stdout)
            assert [r["model"] for r in rows] == [f"mock-{name}"]
            assert f"-{procs[name].pid}-" in rows[0]["worker_id"]  # a worker this `kvflow up` started
            answer = await _run(env, "produce", "--port", str(port), "--model", f"mock-{name}", "--max-tokens", "4",
                                "hi")
            assert answer.returncode == 0, answer.stderr
            assert f"worker={rows[0]['worker_id']}" in answer.stderr and "completion_tokens=4" in answer.stderr
            async with httpx.AsyncClient(base_url=states[name].url, timeout=60) as http:
                reply = (await http.post("/v1/chat/completions", json={
                    "model": f"mock-{name}", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})).json()
                scrape = (await http.get(states[name].metrics_url)).text  # its own embedded broker's process
            assert reply["kvflow"]["policy"] == states[name].routing_policy
            assert "kvflow_broker_process_resident_memory_bytes" in scrape

        both = await _run(env, "status")
        assert both.returncode == 2 and f"port {ports['a']}" in both.stderr and f"port {ports['b']}" in both.stderr
    finally:
        for proc in procs.values():
            await asyncio.to_thread(_stop, proc)
        for log in logs.values():
            log.close()
    assert [p.returncode for p in procs.values()] == [0, 0], [(tmp_path / f"up-{n}.log").read_text()[-2000:]
                                                               for n in ports]
    assert list((data_dir / "deployments").glob("*.json")) == []  # each removed its own state file


async def test_up_without_workers_says_it_serves_no_model(tmp_path):
    """`kvflow up --workers 0` starts broker, router and bridge but no worker, and its ready line says so."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env.update(KVFLOW_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_kvflow("up", "--engine", "mocker", "--workers", "0", "--port", str(free_port())),
                                env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 240
            while "(Ctrl-C to stop)" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()[-2000:]
                assert loop.time() < deadline, log_path.read_text()[-2000:]
                await asyncio.sleep(0.2)
        finally:
            await asyncio.to_thread(_stop, proc)
    out = log_path.read_text()
    assert "starting no worker" in out and "serving no model: no worker was started" in out, out
    assert "SmolLM2" not in out, out
