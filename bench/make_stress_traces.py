"""Write the SLA planner's stress traces (Azure LLM inference CSV format).

One file per shape of :mod:`kvflow.replay.stress` (``step_burst``, ``code``,
``diurnal``, ``isl_shift``), deterministic for a given ``--seed``:

    python bench/make_stress_traces.py --out-dir /tmp/stress --seed 0

Last stdout line: one JSON object, shape → {path, requests, mean ISL/OSL, mean rate}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvflow.replay.stress import SHAPES, StressSpec, generate, write_azure_csv


def main() -> None:
    """Parse arguments, write one CSV per shape, print the summary line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration-s", type=float, default=StressSpec.duration_s)
    ap.add_argument("--base-rate", type=float, default=StressSpec.base_rate_per_s, help="requests/s")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    args = ap.parse_args()
    spec = StressSpec(duration_s=args.duration_s, base_rate_per_s=args.base_rate)
    summary = {}
    for shape in args.shapes.split(","):
        reqs = generate(shape, spec, args.seed)
        path = write_azure_csv(reqs, args.out_dir / f"stress_{shape}.csv")
        n = max(1, len(reqs))
        summary[shape] = {"path": str(path), "requests": len(reqs), "mean_isl": round(sum(r.isl for r in reqs) / n, 1),
                          "mean_osl": round(sum(r.osl for r in reqs) / n, 1),
                          "mean_rate_per_s": round(len(reqs) / spec.duration_s, 3)}
    print(json.dumps({"seed": args.seed, "duration_s": spec.duration_s, "traces": summary}))


if __name__ == "__main__":
    main()
