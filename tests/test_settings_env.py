"""settings_env: the environment that gives a child process the parent's settings.

The child side is real: a fresh interpreter builds ``Settings()`` from the
environment and prints it, as a worker process that ``kvflow up`` starts does.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pydantic import SecretStr

from kvflow.settings import Settings, settings_env

CHANGED = {
    "heartbeat_interval_ms": 250, "worker_ttl_ms": 60_000, "stream_flush_ms": 120, "stream_flush_tokens": 4,
    "embedded_broker": True, "bootstrap_servers": "127.0.0.1:1", "shed_mode": "queue",
    "router_session_margin": None, "shed_cold_start_hold_s": 12.5, "api_keys": ("k1", "k2"),
    "kafka_sasl_plain_password": SecretStr("s3cret"), "vllm_speculative_config": {"method": "ngram", "n": 3},
    "tansu_bin": "/opt/tansu",  # read from CALF_TANSU_BIN, its alias
}


def child_settings(env: dict[str, str]) -> dict:
    code = ("import json; from kvflow.settings import Settings; "
            "s = Settings(); d = s.model_dump(mode='json'); "
            "d['kafka_sasl_plain_password'] = s.kafka_sasl_plain_password and "
            "s.kafka_sasl_plain_password.get_secret_value(); print(json.dumps(d))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_child_process_gets_the_settings_set_in_code():
    parent = Settings().model_copy(update=CHANGED)
    base = {"PATH": "/usr/bin:/bin", "KVFLOW_STREAM_FLUSH_MS": "5", "KVFLOW_MOCKER_SPEC_NUM_DRAFT_TOKENS": "4"}
    env = settings_env(parent, base)
    want = parent.model_dump(mode="json")
    want["kafka_sasl_plain_password"] = "s3cret"
    # The parent's 120 ms wins over the environment's 5; a variable of a field the parent
    # left at its default (set after its settings were built) passes through.
    want["mocker_spec_num_draft_tokens"] = 4
    assert child_settings(env) == want


def test_null_sets_an_optional_field_to_none(monkeypatch):
    monkeypatch.setenv("KVFLOW_ROUTER_SESSION_MARGIN", "null")
    assert Settings().router_session_margin is None


def test_worker_processes_get_the_deployments_settings_but_not_its_api_keys(monkeypatch):
    from kvflow.supervisor import Supervisor, WorkerSpec

    monkeypatch.setenv("KVFLOW_API_KEYS", "from-env")
    settings = Settings().model_copy(update={"api_keys": ("k1",), "stream_flush_ms": 120, "worker_ttl_ms": 60_000})
    env = Supervisor(settings, WorkerSpec(engine="mocker", model="m"), bridge=False)._worker_env()
    assert "KVFLOW_API_KEYS" not in env
    assert (env["KVFLOW_STREAM_FLUSH_MS"], env["KVFLOW_WORKER_TTL_MS"]) == ("120", "60000")
