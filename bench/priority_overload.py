"""Priorities and tenant fairness under 2x overload (offline replay, the live router's core).

Simulated mocker workers (``--workers``, each with a small KV pool of
``--kv-blocks`` blocks of 64 tokens, so KV is what bounds a worker) behind
the router core in ``queue`` shedding mode. A worker is busy above
``--kv-threshold`` KV use or ``--prefill-threshold`` queued prompt tokens;
held requests are released every router tick (1 s, the live heartbeat
interval). In ``priority`` order the class-0 requests find a worker busy
``--reserve`` earlier (``ShedConfig.reserve_fraction``), keeping that share
of the KV for class 1. Steps:

1. capacity: a backlog of requests far beyond what the workers serve in
   ``--seconds``; the completed requests per second are the capacity C;
2. priorities: Poisson arrivals at ``--factor`` x C for ``--seconds``,
   ``--high-share`` of them of class 1 (deadline ``--high-timeout-s``), the
   rest class 0 (deadline ``--low-timeout-s``), replayed with the queue in
   ``fcfs`` order and in ``priority`` order; per class: TTFT p50/p99, the
   share of sent requests answered within the TTFT SLA, and the share shed.
   The SLA (``--sla-ms``) defaults to the high class's TTFT p99 with its
   requests alone (under capacity) plus one router tick (1 s), the cadence
   at which the router releases held requests;
3. fairness: the same rate, one class, two tenants at ``--tenant-ratio``:1,
   ``fcfs`` against ``priority`` order; per tenant: requests served, shed
   share, and each tenant's share of the served requests.

Prompts are unique (no prefix sharing), ISL and OSL uniform in
:data:`ISL_RANGE` and :data:`OSL_RANGE` tokens, seeded.

    python bench/priority_overload.py [--workers 2] [--factor 2] [--seconds 120]

Last stdout line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from kvflow.replay.simulator import SimConfig, simulate
from kvflow.replay.traces import TraceRequest
from kvflow.router.shedding import ShedConfig
from kvflow.workers.engines.mocker_core import MockerConfig

ISL_RANGE = (512, 2048)
"""Prompt tokens, uniform."""
ROUTER_TICK_MS = 1000.0
"""The router core's tick in the replay (``SimConfig.router_tick_ms``; live: the heartbeat interval)."""
OSL_RANGE = (512, 2048)
"""Output tokens, uniform: long enough that the workers, not the router's release cadence
(one held request per worker per 1 s tick), bound the throughput."""


def make_trace(n: int, rate_per_s: float, seed: int, classes: list[tuple[float, dict]]) -> list[TraceRequest]:
    """``n`` Poisson arrivals at ``rate_per_s``; each request draws one of ``classes``
    ((weight, TraceRequest fields)) at random."""
    rng = random.Random(seed)
    weights = [w for w, _ in classes]
    t, out = 0.0, []
    for i in range(n):
        fields = rng.choices(classes, weights)[0][1]
        out.append(TraceRequest(request_id=f"r{i}", index=i, arrival_ms=t, isl=rng.randint(*ISL_RANGE),
                                osl=rng.randint(*OSL_RANGE), token_seed=seed, **fields))
        t += rng.expovariate(rate_per_s) * 1000.0
    return out


def sim_config(args: argparse.Namespace, order: str, reserve: float = 0.0) -> SimConfig:
    mocker = MockerConfig(num_kv_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs)
    shed = ShedConfig(mode="queue", queue_capacity=args.queue_capacity, queue_order=order,
                      kv_threshold=args.kv_threshold, prefill_token_threshold=args.prefill_threshold,
                      reserve_fraction=reserve)
    return SimConfig(workers=args.workers, policy="least_loaded", mocker=mocker, shed=shed,
                     sample_interval_ms=60_000.0)


def capacity_rps(args: argparse.Namespace) -> float:
    """Requests per second the workers complete when offered far more (50 req/s per worker,
    ``reject`` mode: what finds no free worker is shed at once), over ``args.seconds``."""
    seconds = args.seconds
    rate = 50.0 * args.workers
    trace = make_trace(int(rate * seconds), rate, args.seed, [(1.0, {})])
    cfg = sim_config(args, "fcfs")
    cfg.shed = ShedConfig(mode="reject", kv_threshold=args.kv_threshold,
                          prefill_token_threshold=args.prefill_threshold)
    res = simulate(trace, cfg)
    # Served in the window's second half, when the workers are full.
    done = [r for r in res.records if r.ok and seconds * 500.0 <= r.finish_ms <= seconds * 1000.0]
    return len(done) / (seconds / 2)


def by_group(records, trace: list[TraceRequest], key: str, sla_ms: float | None = None) -> dict:
    """Per value of the trace field ``key``: sent, served, shed share, TTFT p50/p99 (ms) of
    the served, and the share of sent requests with a first token within ``sla_ms``."""
    group = {r.request_id: getattr(r, key) for r in trace}
    out: dict = {}
    for value in sorted(set(group.values())):
        recs = [r for r in records if group[r.request_id] == value]
        served = [r for r in recs if r.ok]
        ttft = np.array([r.first_token_ms - r.arrival_ms for r in served]) if served else np.array([np.nan])
        row = {"sent": len(recs), "served": len(served),
               "shed_share": round(sum(1 for r in recs if r.error and r.error.startswith("shed")) / len(recs), 4),
               "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
               "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1)}
        if sla_ms is not None:
            row["within_sla_share"] = round(sum(1 for r in served if r.first_token_ms - r.arrival_ms <= sla_ms)
                                            / len(recs), 4)
        out[str(value)] = row
    total_served = sum(v["served"] for v in out.values()) or 1
    for v in out.values():
        v["served_share"] = round(v["served"] / total_served, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--high-share", type=float, default=0.2)
    p.add_argument("--high-timeout-s", type=float, default=10.0)
    p.add_argument("--low-timeout-s", type=float, default=30.0)
    p.add_argument("--sla-ms", type=float, default=None)
    p.add_argument("--tenant-ratio", type=float, default=10.0)
    p.add_argument("--kv-blocks", type=int, default=600)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-threshold", type=float, default=0.8)
    p.add_argument("--prefill-threshold", type=int, default=4096)
    p.add_argument("--queue-capacity", type=int, default=256)
    p.add_argument("--reserve", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    cap = capacity_rps(args)
    rate = args.factor * cap
    n = int(rate * args.seconds)
    out: dict = {"bench": "priority_overload", "workers": args.workers, "capacity_rps": round(cap, 2),
                 "offered_rps": round(rate, 2), "requests": n}

    classes = [(args.high_share, {"priority": 1, "timeout_ms": args.high_timeout_s * 1000}),
               (1 - args.high_share, {"priority": 0, "timeout_ms": args.low_timeout_s * 1000})]
    trace = make_trace(n, rate, args.seed + 1, classes)
    # The high class's own TTFT, its requests alone (well under capacity): the SLA is that plus one router tick.
    alone = [r for r in trace if r.priority == 1]
    base = by_group(simulate(alone, sim_config(args, "priority")).records, alone, "priority")["1"]
    sla_ms = args.sla_ms if args.sla_ms is not None else base["ttft_p99_ms"] + ROUTER_TICK_MS
    out["high_alone"] = base
    out["sla_ms"] = sla_ms
    out["priorities"] = {}
    for order, reserve in (("fcfs", 0.0), ("priority", args.reserve)):
        res = simulate(trace, sim_config(args, order, reserve))
        out["priorities"][order] = by_group(res.records, trace, "priority", sla_ms)

    ratio = args.tenant_ratio
    tenants = [(ratio / (ratio + 1), {"tenant": "heavy", "timeout_ms": args.low_timeout_s * 1000}),
               (1 / (ratio + 1), {"tenant": "light", "timeout_ms": args.low_timeout_s * 1000})]
    trace = make_trace(n, rate, args.seed + 2, tenants)
    out["fairness"] = {}
    for order in ("fcfs", "priority"):
        res = simulate(trace, sim_config(args, order))
        out["fairness"][order] = by_group(res.records, trace, "tenant")
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
