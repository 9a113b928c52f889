"""Routing quality on a real trace: kv vs round_robin vs random (offline replay).

Replays the Mooncake conversation trace (first 40 minutes) on 8 simulated
mocker workers (Dynamo's mocker defaults: 16,384 blocks of 64 tokens each)
with each policy, through the same routing code the live router runs, and
computes in the same run the two reference hit rates:

- the practical ceiling: one shared LRU prefix cache with the workers'
  combined capacity (8 × 16,384 blocks), fed the trace in arrival order;
- the infinite-cache hit rate (every block ever seen stays cached).

Hit rate = prompt tokens served from cache / prompt tokens. Block identity
follows the trace's ``hash_ids`` (one id per 512-token block, prefix
semantics), split into 64-token blocks; only full blocks count.

    python bench/routing_quality.py [--trace PATH] [--workers 8] [--policies kv,round_robin,random]

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from pathlib import Path

from kvflow.replay import run_offline

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"


def reference_hit_rates(trace: Path, capacity_blocks: int, block_size: int = 64) -> tuple[float, float]:
    """(shared-LRU hit rate at ``capacity_blocks``, infinite-cache hit rate)."""
    per_hash = 512 // block_size
    lru: OrderedDict = OrderedDict()
    seen: set = set()
    hit_lru = hit_inf = total = 0
    with open(trace) as f:
        for line in f:
            rec = json.loads(line)
            isl, ids = rec["input_length"], rec["hash_ids"]
            total += isl
            n_full = isl // block_size
            keys = []
            chain: tuple = ()
            for k in range(n_full):
                if k % per_hash == 0:
                    chain = (hash(chain), ids[k // per_hash])
                keys.append((chain, k % per_hash))
            lru_prefix = next((i for i, key in enumerate(keys) if key not in lru), len(keys))
            inf_prefix = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
            hit_lru += lru_prefix * block_size
            hit_inf += inf_prefix * block_size
            for key in keys:
                lru[key] = True
                lru.move_to_end(key)
                seen.add(key)
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hit_lru / total, hit_inf / total


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--policies", default="kv,round_robin,random")
    args = ap.parse_args()
    out: dict = {"bench": "routing_quality", "trace": args.trace.name, "workers": args.workers}
    blocks_per_worker = 16384
    ceiling, infinite = reference_hit_rates(args.trace, blocks_per_worker * args.workers)
    out["ceiling_shared_lru_hit_rate"] = round(ceiling, 4)
    out["infinite_cache_hit_rate"] = round(infinite, 4)
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        report = run_offline(args.trace, workers=args.workers, policy=policy, progress=False)
        out[policy] = {
            "prefix_hit_rate": round(report.prefix_hit_rate, 4),
            "ttft_p50_ms": round(report.ttft_ms.p50, 1), "ttft_p99_ms": round(report.ttft_ms.p99, 1),
            "tpot_p99_ms": round(report.tpot_ms.p99, 2), "itl_p99_ms": round(report.itl_ms.p99, 2),
            "completed": report.completed, "shed": report.shed, "queued": report.queued,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(f"{policy}: {out[policy]}", flush=True)
    if "kv" in out and "round_robin" in out:
        out["kv_vs_round_robin_hit_ratio"] = round(out["kv"]["prefix_hit_rate"] / out["round_robin"]["prefix_hit_rate"], 2)
        out["kv_vs_ceiling"] = round(out["kv"]["prefix_hit_rate"] / ceiling, 3)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
