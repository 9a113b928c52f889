"""The SLA planner on traffic it was not tuned on: stress traces and the public Azure trace.

For each trace, the planner (one configuration, :func:`default_planner_config`,
the same for every trace) runs in the offline simulator, then the same trace
runs on static pools (:func:`kvflow.replay.planner_eval.evaluate_planner`):
static peak (the smallest fixed pool meeting ``--sla-target``, searched up
to ``--max-workers``) and static mean (the planner's mean, rounded up).

Traces: the four shapes of :mod:`kvflow.replay.stress` (``step_burst``,
``code``, ``diurnal``, ``isl_shift``; seeded by ``--seed``) and the Azure
conversation trace (``--azure-end-s`` keeps its first part; 0 skips it).

Engine: the mocker slowed down 4× (``--speedup-ratio 0.25``, as in the
documented Azure planner run) so that the traces need several replicas.
A worker the planner starts serves ``--worker-startup-s`` simulated seconds
later; the planner measures that delay from the workers it started (until
the first one is ready it assumes the configured ``worker_startup_s``).
Several comma-separated values run the whole evaluation once each; the
default ``1,30`` is a mocker worker's measured start-up
(``bench/worker_startup.py``: 0.9–1.1 s from spawn to serving) and a
GPU-like 30 s.

The planner sizes with aggregated mocker profiles taken at each mean OSL of
:data:`kvflow.replay.planner_eval.PROFILE_OSLS` (16 to 512 tokens), read at
its latency statistics (p99 grids for the p99 ITL target) and blended around
the mean OSL it observes (:class:`kvflow.planner.interpolation.PerfFamily`);
``--fixed-profile-osl N`` sizes with one profile at N tokens instead, as
before.

The planner starts from ``--initial-workers`` workers (default 2); ``warm``
starts from the pool the planner core sizes for the first interval's load
before it has learnt any correction
(:func:`kvflow.replay.planner_eval.warm_start_replicas`).

Worker pools (``--no-pools`` skips them): a two-pool trace, the step burst
at half rate beside code traffic at a quarter rate, routed by a pool grid
(context under 1,500 tokens: pool ``short``, mostly the step burst; longer:
pool ``long``, mostly the code traffic), with one
planner per pool (:mod:`kvflow.replay.pool_planner`) against each pool's
own static peak (the smallest fixed size meeting the target on that
pool's requests).

Target per trace: SLA attainment (TTFT <= 500 ms and per-request mean ITL
<= 50 ms) >= 99% at <= 70% of static peak's replica-hours, where static
peak meets 99%. The ×4 step burst's reaction time is the time from the
burst's start to the first replica the planner added after it serving;
its bound is one start-up time + 5 s.

    python bench/planner_eval.py [--plots docs/planner] [--azure-end-s 3600] [--worker-startup-s 1,30]

Last stdout line: one JSON object with a row per trace.

Trace attribution: Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv, CC-BY-4.0 (Patel et al.,
"Splitwise: Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvflow, not an installed copy

from kvflow.planner.core import PlannerConfig  # noqa: E402
from kvflow.planner.interpolation import PerfFamily, PerfModel, PerfSource  # noqa: E402
from kvflow.planner.profile import Profile  # noqa: E402
from kvflow.replay.planner_eval import (  # noqa: E402
    PlannerEvaluation,
    aggregated_mocker_profiles,
    evaluate_planner,
    profile_for,
    replica_hours,
    worker_lifetimes,
    warm_start_replicas,
)
from kvflow.replay.pool_planner import run_pool_planner  # noqa: E402
from kvflow.replay.report import sla_attainment  # noqa: E402
from kvflow.replay.simulator import SimConfig, simulate  # noqa: E402
from kvflow.replay.stress import SHAPES, StressSpec, burst_window_s, generate, write_azure_csv  # noqa: E402
from kvflow.replay.traces import read_trace  # noqa: E402
from kvflow.router.pools import DecodeGrid, PoolGrid, PrefillGrid  # noqa: E402
from kvflow.schemas import WorkerRole  # noqa: E402
from kvflow.workers.engines.mocker_core import MockerConfig  # noqa: E402

SLA_TTFT_MS, SLA_ITL_MS = 500.0, 50.0


def default_trace() -> Path:
    """The repo copy of the Azure conversation trace if present, else the shared one."""
    local = ROOT / "examples" / "traces" / "azure2023_conv.csv"
    return local if local.exists() else ROOT.parent / "shared" / "traces" / "azure2023_conv.csv"


def default_planner_config(max_workers: int, worker_startup_s: float) -> PlannerConfig:
    """The one planner configuration every trace runs with (aggregated mode)."""
    return PlannerConfig(
        ttft_ms=SLA_TTFT_MS, itl_ms=SLA_ITL_MS, adjustment_interval_s=30.0, mode="aggregated",
        predictor="backtest", ttft_statistic="mean", itl_statistic="p99", correction_smoothing=0.5,
        min_aggregated_replicas=1, max_gpus=max_workers, scale_down_hold_intervals=3, correction_max=1.6,
        worker_startup_s=worker_startup_s)


def pools_trace(seed: int, tmp: Path) -> Path:
    """The two-pool trace: ``step_burst`` at 4 requests/s beside ``code`` at 2 requests/s, 600 s."""
    reqs = generate("step_burst", StressSpec(base_rate_per_s=4.0), seed) + \
        generate("code", StressSpec(base_rate_per_s=2.0), seed + 1)
    return write_azure_csv(sorted(reqs, key=lambda r: r.arrival_s), tmp / "stress_pools.csv")


def pool_grid() -> PoolGrid:
    """Prompts under 1,500 tokens → prefill pool ``short``, else ``long``; context (prompt plus output)
    under 1,500 tokens → decode pool ``short``, else ``long`` (an aggregated worker of the decode pool
    serves the whole request)."""
    return PoolGrid(prefill=PrefillGrid(isl_step_tokens=1500, ttft_step_ms=10_000, grid=[["short"], ["long"]]),
                    decode=DecodeGrid(context_step_tokens=1500, itl_step_ms=10_000, grid=[["short"], ["long"]]))


def static_pool_peak(trace, sim: SimConfig, pools: list[str], max_workers: int, sla_target: float
                     ) -> dict[str, tuple[int, float, float]]:
    """Per pool: the smallest fixed size meeting ``sla_target`` on the pool's requests (bisection; pools
    are independent under the grid, so the other pool runs at ``max_workers``), its attainment and
    replica-hours."""
    out = {}
    for pool in pools:
        cache: dict[int, tuple[float, float]] = {}

        def run(n: int) -> tuple[float, float]:
            if n not in cache:
                res = simulate(trace, replace(sim, pool_workers={p: (n if p == pool else max_workers) for p in pools}))
                grid = sim.pool_grid
                mine = [r for r in res.records
                        if (res.worker_pools[r.worker_id] if r.worker_id else grid.choose(r.isl, r.osl).decode) == pool]
                life = worker_lifetimes(res.records, res.worker_ids, res.end_ms)
                hours = replica_hours({w: s for w, s in life.items() if res.worker_pools[w] == pool})
                cache[n] = (sla_attainment(mine, SLA_TTFT_MS, SLA_ITL_MS), hours)
            return cache[n]

        lo, hi = 1, max_workers
        while lo < hi:
            mid = (lo + hi) // 2
            if run(mid)[0] >= sla_target:
                hi = mid
            else:
                lo = mid + 1
        out[pool] = (hi, *run(hi))
    return out


def perf_of(profile: Profile | list[Profile], cfg: PlannerConfig) -> PerfSource:
    """The planner's model of one profile, or the OSL family of several, read at the
    planner's latency statistics (p99 grids for a p99 target)."""
    stats = {"ttft_statistic": cfg.ttft_statistic, "itl_statistic": cfg.itl_statistic}
    return (PerfModel.from_profile(profile, **stats) if isinstance(profile, Profile)
            else PerfFamily.from_profiles(profile, **stats))


def pools_rows(args, cfg: PlannerConfig, perf: PerfSource, mocker: MockerConfig, startup_s: float,
               tmp: Path) -> list[dict]:
    """One row per pool of the two-pool trace: its planner against its own static peak."""
    trace = read_trace(pools_trace(args.seed, tmp))
    grid = pool_grid()
    sim = SimConfig(workers=0, policy="round_robin", mocker=mocker, worker_startup_ms=startup_s * 1000.0,
                    pool_grid=grid)
    run = run_pool_planner(trace, sim, {"short": cfg, "long": cfg}, perf,
                           initial={"short": {WorkerRole.aggregated: 2}, "long": {WorkerRole.aggregated: 2}},
                           sla_ttft_ms=SLA_TTFT_MS, sla_itl_ms=SLA_ITL_MS)
    static = static_pool_peak(trace, replace(sim, worker_startup_ms=0.0), ["short", "long"], args.max_workers,
                              args.sla_target)
    rows = []
    for pool, figures in run.pools.items():
        n, attainment, hours = static[pool]
        planned = figures.replica_hours["aggregated"]
        rows.append({"trace": f"pools/{pool}", "worker_startup_s": startup_s, "requests": figures.requests,
                     "planner_attainment": round(figures.sla_attainment, 4),
                     "planner_replica_hours": round(planned, 3),
                     "planner_mean_workers": round(figures.mean_workers["aggregated"], 2),
                     "planner_max_workers": figures.max_workers["aggregated"],
                     "static_peak_workers": n, "static_peak_attainment": round(attainment, 4),
                     "static_peak_replica_hours": round(hours, 3),
                     "replica_hours_vs_static_peak": round(planned / hours, 4) if hours else None,
                     "meets_target": bool(attainment >= args.sla_target and figures.sla_attainment >= args.sla_target
                                          and hours and planned / hours <= 0.70)})
    return rows


def reaction_s(ev: PlannerEvaluation, burst_start_s: float) -> float | None:
    """Seconds from ``burst_start_s`` until the first worker the planner started after it serves."""
    starts = [t for t in ev.planner.hook.started_ms.values() if t >= burst_start_s * 1000.0]
    if not starts:
        return None
    return (min(starts) + ev.summary.settings["worker_startup_ms"]) / 1000.0 - burst_start_s


def plot(name: str, ev: PlannerEvaluation, out_dir: Path, window_s: float = 30.0) -> str:
    """Workers over time against the arrival rate, and TTFT and per-request ITL p99 per window
    of arrivals; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = ev.planner.result.records
    end_s = ev.planner.result.end_ms / 1000.0
    edges = np.arange(0.0, end_s + window_s, window_s)
    arrivals = np.array([r.arrival_ms / 1000.0 for r in recs])
    rate = np.histogram(arrivals, bins=edges)[0] / window_s
    p99, itl99 = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        window = [r for r in recs if a <= r.arrival_ms / 1000.0 < b and r.first_token_ms is not None]
        ttft = [r.first_token_ms - r.arrival_ms for r in window]
        itl = [(r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1) for r in window
               if r.output_tokens > 1 and r.last_token_ms is not None]
        p99.append(np.percentile(ttft, 99) if ttft else np.nan)
        itl99.append(np.percentile(itl, 99) if itl else np.nan)
    steps = ev.summary.replicas
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.step([s.t_s for s in steps], [s.live for s in steps], where="post", label="planner: live workers")
    ax1.step([s.t_s for s in steps], [s.serving for s in steps], where="post", ls=":", label="serving")
    ax1.axhline(ev.summary.static_peak_replicas, color="grey", ls="--", label="static peak")
    ax1.set_ylabel("workers")
    axr = ax1.twinx()
    axr.plot(edges[:-1] + window_s / 2, rate, color="tab:orange", alpha=0.7, label="arrivals/s")
    axr.set_ylabel("requests/s")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title(f"{name}: SLA planner")
    mid = edges[:-1] + window_s / 2
    ax2.plot(mid, p99, marker=".", label="TTFT p99")
    ax2.axhline(SLA_TTFT_MS, color="tab:blue", ls="--", lw=0.8, label="TTFT SLA")
    ax2.set_yscale("log")
    ax2.set_ylabel(f"TTFT p99 per {window_s:g} s (ms)")
    ax2.set_xlabel("arrival time (s)")
    ax3 = ax2.twinx()
    ax3.plot(mid, itl99, marker=".", color="tab:red", label="per-request ITL p99")
    ax3.axhline(SLA_ITL_MS, color="tab:red", ls="--", lw=0.8, label="ITL SLA")
    ax3.set_ylabel("ITL p99 (ms)")
    ax2.legend(loc="upper left", fontsize=8)
    ax3.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"planner_{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def trace_row(name: str, path: Path, burst_start: float | None, args, cfg: PlannerConfig, profile,
              mocker: MockerConfig, startup_s: float) -> dict:
    """Evaluate one trace at one start-up time: the planner against static peak and static mean."""
    t0 = time.perf_counter()
    trace = read_trace(path, end_ms=args.azure_end_s * 1000 if name == "azure_conv" else None)
    initial = (warm_start_replicas(trace, cfg, perf_of(profile, cfg)) if args.initial_workers == "warm"
               else int(args.initial_workers))
    sim = SimConfig(workers=initial, policy="round_robin", mocker=mocker, worker_startup_ms=startup_s * 1000.0)
    ev = evaluate_planner(trace, sim, cfg, max_replicas=args.max_workers, sla_ttft_ms=SLA_TTFT_MS,
                          sla_itl_ms=SLA_ITL_MS, sla_target=args.sla_target, profile=profile,
                          fast_interval_s=None if args.no_fast_path else 1.0)
    s = ev.summary
    ttft_ok = sum(r.ok and r.first_token_ms is not None and r.first_token_ms - r.arrival_ms <= SLA_TTFT_MS
                  for r in ev.planner.result.records) / max(1, len(trace.requests))
    row = {
        "trace": name, "worker_startup_s": startup_s, "requests": len(trace.requests), "initial_workers": initial,
        "planner_attainment": round(ev.planner.sla_attainment, 4), "planner_ttft_attainment": round(ttft_ok, 4),
        "planner_replica_hours": round(ev.planner.replica_hours, 3),
        "planner_mean_workers": round(s.planner_mean_replicas, 2), "planner_max_workers": s.planner_max_replicas,
        "static_peak_workers": s.static_peak_replicas, "static_peak_meets_sla": s.static_peak_meets_target,
        "static_peak_attainment": round(ev.static_peak.sla_attainment, 4),
        "static_peak_replica_hours": round(ev.static_peak.replica_hours, 3),
        "static_mean_workers": s.static_mean_replicas,
        "static_mean_attainment": round(ev.static_mean.sla_attainment, 4),
        "static_mean_replica_hours": round(ev.static_mean.replica_hours, 3),
        "replica_hours_vs_static_peak": round(s.replica_hours_vs_static_peak, 4),
        "reactive_scale_ups": len(ev.planner.hook.reactive_ms),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    row["meets_target"] = bool(s.static_peak_meets_target and ev.planner.sla_attainment >= args.sla_target
                               and s.replica_hours_vs_static_peak <= 0.70)
    if burst_start is not None:
        r = reaction_s(ev, burst_start)
        row["burst_reaction_s"] = None if r is None else round(r, 1)
        row["burst_reaction_bound_s"] = startup_s + 5.0
    if args.plots is not None:
        row["plot"] = plot(f"{name}_{startup_s:g}s", ev, args.plots)
    return row


def main() -> None:
    """Parse arguments, run every trace at every start-up time, print each row to stderr and one JSON
    line to stdout."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="stress-trace seed")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--azure", type=Path, default=default_trace())
    ap.add_argument("--azure-end-s", type=float, default=3600.0, help="keep the Azure trace's first S s (0: skip)")
    ap.add_argument("--speedup-ratio", type=float, default=0.25)
    ap.add_argument("--worker-startup-s", default="1,30",
                    help="comma-separated start-up times, s (1: a mocker worker's measured start-up)")
    ap.add_argument("--max-workers", type=int, default=32)
    ap.add_argument("--initial-workers", default="2", help="workers at start, or warm (module docstring)")
    ap.add_argument("--sla-target", type=float, default=0.99)
    ap.add_argument("--no-fast-path", action="store_true", help="interval ticks only (for comparison)")
    ap.add_argument("--no-pools", action="store_true", help="skip the two-pool run")
    ap.add_argument("--plots", type=Path, default=None, help="write one PNG per trace and start-up time here")
    ap.add_argument("--fixed-profile-osl", type=float, default=None,
                    help="size with one aggregated profile at this OSL instead of the OSL family (for comparison)")
    args = ap.parse_args()
    startups = [float(v) for v in args.worker_startup_s.split(",") if v]

    mocker = MockerConfig(speedup_ratio=args.speedup_ratio)
    # One set of profiles for every trace: aggregated closed loop at each OSL of PROFILE_OSLS; the planner
    # blends the two around the OSL it observes (PerfFamily). --fixed-profile-osl: one profile at one OSL.
    profile = (aggregated_mocker_profiles(mocker) if args.fixed_profile_osl is None
               else profile_for(mocker, "aggregated", osl=args.fixed_profile_osl))
    spec = StressSpec()
    traces: list[tuple[str, Path, float | None]] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvflow-stress-"))
    for shape in [s for s in args.shapes.split(",") if s]:
        path = write_azure_csv(generate(shape, spec, args.seed), tmp / f"stress_{shape}.csv")
        traces.append((shape, path, burst_window_s(spec, args.seed)[0] if shape == "step_burst" else None))
    if args.azure_end_s > 0:
        traces.append(("azure_conv", args.azure, None))

    rows = []
    for startup_s in startups:
        cfg = default_planner_config(args.max_workers, startup_s)
        for name, path, burst_start in traces:
            rows.append(trace_row(name, path, burst_start, args, cfg, profile, mocker, startup_s))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if not args.no_pools:
            for row in pools_rows(args, cfg, perf_of(profile, cfg), mocker, startup_s, tmp):
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"speedup_ratio": args.speedup_ratio, "worker_startup_s": startups,
                      "initial_workers": args.initial_workers, "max_workers": args.max_workers, "seed": args.seed,
                      "fast_path": not args.no_fast_path, "fixed_profile_osl": args.fixed_profile_osl,
                      "sla": {"ttft_ms": SLA_TTFT_MS, "itl_ms": SLA_ITL_MS, "target": args.sla_target},
                      "rows": rows}))


if __name__ == "__main__":
    main()
