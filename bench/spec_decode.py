"""Speculative decoding in the mocker: the ITL change at a given acceptance rate (offline replay).

Replays the same trace (Poisson arrivals at ``--rate`` req/s for
``--seconds``, ISL uniform in [256, 2,048], OSL uniform in [128, 1,024],
unique prompts) on ``--workers`` mocker workers, without speculation and
with ``--draft-tokens`` k draft tokens per step at each acceptance rate α of
``--alphas`` (``MockerConfig.spec_*``), for a draft model costing
``--draft-cost`` of a target pass (0 = prompt lookup). Per run: each
request's mean ITL (last − first token over output tokens − 1) at p50 and
p99, TTFT p50, the workers' acceptance rate (accepted / draft tokens) and
mean accepted length (1 + accepted / verify passes), and, for reference, the
expected speedup of Leviathan et al. (ICML 2023, eq. for the walltime
improvement) ``(1 − α^(k+1)) / ((1 − α)(k·c + 1))``.

    python bench/spec_decode.py [--alphas 0.5,0.7,0.9] [--draft-tokens 4] [--draft-cost 0.05]

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import numpy as np

from kvflow.replay.simulator import SimConfig, Simulation
from kvflow.replay.traces import TraceRequest
from kvflow.workers.engines.mocker_core import MockerConfig


def make_trace(n: int, rate: float, seed: int) -> list[TraceRequest]:
    """``n`` Poisson arrivals (module docstring)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(TraceRequest(request_id=f"r{i}", index=i, arrival_ms=t, isl=rng.randint(256, 2048),
                                osl=rng.randint(128, 1024), token_seed=seed))
        t += rng.expovariate(rate) * 1000.0
    return out


def run(trace: list[TraceRequest], workers: int, mocker: MockerConfig) -> dict:
    """Replay ``trace`` and summarise ITL, TTFT and the workers' speculation counters."""
    sim = Simulation(trace, SimConfig(workers=workers, policy="least_loaded", mocker=mocker,
                                      sample_interval_ms=60_000.0))
    res = sim.run()
    ok = [r for r in res.records if r.ok]
    itl = [(r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ttft = [r.first_token_ms - r.arrival_ms for r in ok]
    cores = [w.core for w in sim.workers.values()]
    drafts = sum(c.spec_draft_tokens for c in cores)
    accepted = sum(c.spec_accepted_tokens for c in cores)
    verifies = sum(c.spec_verify_steps for c in cores)
    return {"completed": len(ok), "itl_p50_ms": round(float(np.percentile(itl, 50)), 2),
            "itl_p99_ms": round(float(np.percentile(itl, 99)), 2),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
            "mean_accepted_length": round(1 + accepted / verifies, 3) if verifies else None,
            "engine_steps": res.steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--alphas", default="0.5,0.7,0.9")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--draft-cost", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    trace = make_trace(int(args.rate * args.seconds), args.rate, args.seed)
    base = MockerConfig()
    k, c = args.draft_tokens, args.draft_cost
    out: dict = {"bench": "spec_decode", "requests": len(trace), "draft_tokens": k, "draft_cost": c,
                 "off": run(trace, args.workers, base)}
    for alpha in (float(a) for a in args.alphas.split(",")):
        mocker = replace(base, spec_num_draft_tokens=k, spec_acceptance_rate=alpha, spec_draft_cost_ratio=c)
        row = run(trace, args.workers, mocker)
        row["itl_p50_speedup"] = round(out["off"]["itl_p50_ms"] / row["itl_p50_ms"], 3)
        row["expected_speedup"] = round((1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)), 3)
        out[f"alpha_{alpha}"] = row
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
