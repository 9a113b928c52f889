"""Offline replay with KV tiers: `kvflow replay --kv-host-gb/--kv-disk-gb/--num-kv-blocks` and the report fields."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvflow.cli import app


def replay(tmp_path, *args: str) -> dict:
    # A: 1,024 tokens; B: 1,024 other tokens (pushes A out of a 17-block G1); A again, 10 s later each.
    trace = tmp_path / "again.jsonl"
    rows = [(0, [1, 2]), (10_000, [3, 4]), (20_000, [1, 2])]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 1024, "output_length": 2, "hash_ids": ids})
                             + "\n" for t, ids in rows))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["replay", str(trace), "--mode", "offline", "--workers", "1", "--no-progress",
                                      "--num-kv-blocks", "17", "--json", str(out), *args])
    assert result.exit_code == 0, result.output
    assert "- KV tiers: hit rate device" in result.output
    return json.loads(out.read_text())


def test_without_host_tier_the_evicted_prompt_is_recomputed(tmp_path):
    r = replay(tmp_path)
    assert r["cached_tokens"] == 0 and r["recomputed_prefill_tokens"] == 1024  # A's 16 full blocks
    assert r["tier_hit_rates"] == {"device": 0.0, "host": 0.0, "disk": 0.0} and r["kv_tiers"] is None


def test_host_tier_onboards_the_evicted_prompt(tmp_path):
    r = replay(tmp_path, "--kv-host-gb", "1")
    # 15 blocks onboarded; the last full block is computed again (a prompt always computes >= 1 token).
    assert r["cached_tokens"] == 960 and r["recomputed_prefill_tokens"] == 64
    assert r["tier_hit_rates"]["host"] == pytest.approx(960 / 3072) and r["tier_hit_rates"]["device"] == 0.0
    assert r["kv_tiers"]["onboarded_host_blocks"] == 15 and r["kv_tiers"]["onboard_ms"] > 0
    assert r["kv_tiers"]["offloaded_bytes"] == r["kv_tiers"]["offloaded_blocks"] * 64 * 131072


def test_online_mode_refuses_tier_sizes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}) + "\n")
    result = CliRunner().invoke(app, ["replay", str(trace), "--mode", "online", "--url", "http://127.0.0.1:9",
                                      "--kv-host-gb", "1"])
    assert result.exit_code != 0 and "--kv-host-gb" in result.output
