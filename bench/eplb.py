"""EPLB on skewed expert loads: GPU imbalance (max / mean load) before and after balancing.

Per-expert loads of ``--layers`` MoE layers with ``--experts`` experts: a
million tokens per layer routed by Zipf weights (exponent ``--zipf``) over a
random expert order. Unbalanced reference: no replicas, experts split into
contiguous runs over ``--gpus`` GPUs. Balanced: :func:`kvflow.planner.eplb.balance`
with ``--spare`` extra slots per GPU (so ``gpus · (experts/gpus + spare)``
physical experts), globally and hierarchically (``--groups`` groups over
``--nodes`` nodes).

    python bench/eplb.py [--experts 64] [--gpus 8] [--spare 2] [--zipf 1.2]

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvflow.planner.eplb import balance, contiguous_imbalance


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--spare", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    weights = 1.0 / np.arange(1, args.experts + 1) ** args.zipf
    load = np.stack([rng.multinomial(1_000_000, weights / weights.sum())[rng.permutation(args.experts)]
                     for _ in range(args.layers)]).astype(float)
    slots = args.experts // args.gpus + args.spare
    t0 = time.perf_counter()
    flat = balance(load, args.gpus, slots)
    t_flat = time.perf_counter() - t0
    hier = balance(load, args.gpus, slots, num_groups=args.groups, num_nodes=args.nodes)
    before = contiguous_imbalance(load, args.gpus)

    def stats(x: np.ndarray) -> dict:
        return {"mean": round(float(x.mean()), 3), "max": round(float(x.max()), 3)}

    print(json.dumps({"bench": "eplb", "layers": args.layers, "experts": args.experts, "gpus": args.gpus,
                      "slots_per_gpu": slots, "zipf": args.zipf, "unbalanced": stats(before),
                      "global": stats(flat.imbalance),
                      "hierarchical": {**stats(hier.imbalance), "used": hier.hierarchical},
                      "global_ms_per_layer": round(t_flat / args.layers * 1000, 2)}))


if __name__ == "__main__":
    main()
