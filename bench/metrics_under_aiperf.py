"""Scrape a live ``kvflow up`` before and after AIPerf load: which series moved, by how much.

1. Start ``kvflow up --engine mocker --workers W --planner sla`` with
   ``--metrics-port`` (one scrape point: router, planner, bridge, consumer
   lag and every worker), mocker workers tokenizing like SmolLM2.
2. Scrape it, run ``kvflow aiperf`` on the first ``--limit`` requests of the
   Mooncake trace (``KVFLOW_AIPERF`` names the aiperf executable, see
   docs/aiperf.md), wait two planner intervals, scrape again.

    KVFLOW_AIPERF=~/.venvs/aiperf/bin/aiperf python bench/metrics_under_aiperf.py [--limit 40] [--workers 2]

Last stdout line: one JSON object: for each watched series, its total
(summed over label sets) before the load, its highest value in scrapes
every 2 s during it, and after it; and the number of sample names exported
per process kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_from_topics import free_port, wait_healthy  # noqa: E402

TRACE = Path(__file__).resolve().parent.parent / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"
MODEL = "SmolLM2-135M-Instruct"
WATCHED = [
    "kvflow_worker_requests_total", "kvflow_worker_generated_tokens_total", "kvflow_worker_prefill_tokens_total",
    "kvflow_worker_prefix_hit_tokens_total", "kvflow_worker_ttft_seconds_count", "kvflow_worker_kv_blocks_used",
    "kvflow_router_decisions_total", "kvflow_router_overlap_blocks_sum", "kvflow_router_index_blocks",
    "kvflow_router_kv_event_apply_lag_seconds_count", "kvflow_planner_ticks_total",
    "kvflow_planner_observed_requests_per_second", "kvflow_planner_predicted_requests_per_second",
    "kvflow_planner_replicas", "kvflow_consumer_lag_records", "kvflow_bridge_requests_total",
]


def scrape(url: str) -> dict[str, float]:
    """Sample name → value summed over label sets (``kvflow_planner_replicas``: the target only)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        for s in family.samples:
            if s.name == "kvflow_planner_replicas" and s.labels.get("kind") != "target":
                continue
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def main() -> None:
    """Run the benchmark (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=5.0, help="planner adjustment interval")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="kvflow-metrics-bench-"))
    port, metrics_port = free_port(), free_port()
    join = ["--port", str(port), "--data-dir", str(out / "data")]
    up = subprocess.Popen(
        [sys.executable, "-m", "kvflow", "up", "--engine", "mocker", "--workers", str(args.workers), "--model", MODEL,
         "--mocker-tokenizer", MODEL, "--speedup-ratio", "10", "--planner", "sla", "--adjustment-interval-s",
         str(args.interval_s), "--metrics-port", str(metrics_port), *join],
        stdout=(out / "up.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}"))
        before = scrape(url)
        while before.get("kvflow_worker_info", 0) < args.workers or "kvflow_planner_sla_ttft_seconds" not in before:
            time.sleep(0.5)  # every worker's /metrics merged in, and the planner started
            before = scrape(url)
        started = time.monotonic()
        aiperf = subprocess.Popen([sys.executable, "-m", "kvflow", "aiperf", str(TRACE), "--limit", str(args.limit),
                                   "--max-input-length", "40000", "--artifact-dir", str(out / "aiperf"), *join],
                                  stdout=(out / "aiperf.log").open("w"), stderr=subprocess.STDOUT)
        peak: dict[str, float] = {}
        while aiperf.poll() is None:  # gauges during the load: their highest value
            time.sleep(2)
            for name, value in scrape(url).items():
                peak[name] = max(peak.get(name, value), value)
        if aiperf.returncode != 0:
            raise RuntimeError(f"kvflow aiperf failed; see {out / 'aiperf.log'}")
        load_s = time.monotonic() - started
        time.sleep(args.interval_s + 1)  # the planner's last tick covers the end of the load
        after = scrape(url)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
    kinds = {}
    for name in after:
        kind = name.split("_")[1] if name.startswith("kvflow_") else "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    print(json.dumps({"limit": args.limit, "workers": args.workers, "load_s": round(load_s, 1),
                      "series": {n: {"before": before.get(n), "peak": peak.get(n), "after": after.get(n)}
                                 for n in WATCHED},
                      "sample_names_per_kind": kinds, "out": str(out)}))


if __name__ == "__main__":
    main()
