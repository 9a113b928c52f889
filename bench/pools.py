"""Worker pools and the global router's grid (offline replay, the live router's core).

Four simulated mocker workers serve a mix of short and long prompts: by
default 80% short (ISL uniform in [128, 2,048] tokens, TTFT target
300 ms) and 20% long (ISL uniform in [8,192, 16,384], no target), OSL
uniform in [64, 512], Poisson arrivals at ``--rate`` req/s for ``--seconds``.
Two deployments of the same four workers, ``kv`` policy:

* ``one_pool``: every worker in one pool;
* ``grid``: two ``low-latency`` and two ``long-context`` workers, with the
  grid of ``examples/pools.toml`` (ISL >= 8,192 or context >= 8,192 tokens
  → ``long-context``, the rest → ``low-latency``).

Reported per request class (short, long) and per pool
(:func:`kvflow.replay.pool_report.pool_report`): completed, TTFT p50/p99,
mean ITL p50/p99.

    python bench/pools.py [--rate 6] [--seconds 300]

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from kvflow.replay.pool_report import pool_report
from kvflow.replay.simulator import SimConfig, simulate
from kvflow.replay.traces import TraceRequest
from kvflow.router.pools import load_pool_grid

GRID = Path(__file__).resolve().parents[1] / "examples" / "pools.toml"


def make_trace(n: int, rate: float, long_share: float, seed: int) -> list[TraceRequest]:
    """``n`` Poisson arrivals; a ``long_share`` of them long prompts (module docstring)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        long = rng.random() < long_share
        isl = rng.randint(8192, 16384) if long else rng.randint(128, 2048)
        out.append(TraceRequest(request_id=f"{'long' if long else 'short'}-{i}", index=i, arrival_ms=t, isl=isl,
                                osl=rng.randint(64, 512), token_seed=seed,
                                ttft_target_ms=None if long else 300.0))
        t += rng.expovariate(rate) * 1000.0
    return out


def by_class(records) -> dict:
    """TTFT and mean-ITL percentiles (ms) per request class (the request id's prefix)."""
    out = {}
    for cls in ("short", "long"):
        ok = [r for r in records if r.request_id.startswith(cls) and r.ok]
        ttft = [r.first_token_ms - r.arrival_ms for r in ok]
        itl = [(r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        out[cls] = {"completed": len(ok),
                    "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
                    "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
                    "itl_p50_ms": round(float(np.percentile(itl, 50)), 2),
                    "itl_p99_ms": round(float(np.percentile(itl, 99)), 2)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=6.0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--policy", default="kv")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    trace = make_trace(int(args.rate * args.seconds), args.rate, args.long_share, args.seed)
    grid = load_pool_grid(GRID)
    runs = {"one_pool": SimConfig(workers=4, policy=args.policy, sample_interval_ms=60_000.0),
            "grid": SimConfig(workers=0, policy=args.policy, sample_interval_ms=60_000.0, pool_grid=grid,
                              pool_workers={"low-latency": 2, "long-context": 2})}
    out: dict = {"bench": "pools", "requests": len(trace), "rate_rps": args.rate, "policy": args.policy}
    for name, cfg in runs.items():
        res = simulate(trace, cfg)
        out[name] = {"by_class": by_class(res.records), "by_pool": pool_report(res.records, res.worker_pools),
                     "router": {k: res.router_counts[k] for k in ("routed", "pool_fallbacks")}}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
