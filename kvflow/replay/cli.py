"""``kvflow replay``: offline simulation, online replay, and report comparison.

    kvflow replay TRACE --mode offline [--workers N] [--policy POLICY] [--seed S] [--json PATH]
                        [--shed-mode queue --shed-queue-capacity 64]
                        [--num-kv-blocks B] [--kv-host-gb G2] [--kv-disk-gb G3]
    kvflow replay TRACE --mode offline --prefill-workers P --decode-workers D [--workers N]
                        [--disagg-threshold-tokens 1000] [--disagg-max-prefill-queue 2]
    kvflow replay TRACE --mode offline --planner sla --ttft-ms 500 --itl-ms 50 [--predictor kalman]
                        [--adjustment-interval-s 60] [--min-workers 1] [--max-workers 16]
    kvflow replay TRACE --mode online  [--port P | --bootstrap-servers ... | --url http://...]
    kvflow replay compare a.json b.json ... [--plots DIR]   (DIR: CDF and load PNGs)
    kvflow replay --from-topics --since -10m [--until now] [--policy round_robin] [--workers N]
                  [--recorded-json recorded.json] [--json replayed.json] [--save-trace trace.jsonl]

With ``--from-topics`` the trace is a running deployment's own log: the
requests created in ``[--since, --until)``, read back from its topics
(:mod:`kvflow.replay.from_log`), are replayed offline with the policy,
worker count and planner given here (workers default to the number the
recorded decisions routed to; the mocker's KV geometry to theirs), and the
recorded run is summarised beside the replay (``--recorded-json`` writes it
as a report for ``kvflow replay compare``).

With ``--planner sla`` the offline run is sized by the SLA planner (starting
from ``--workers``), and the same trace is also run on the static-peak pool
(the smallest static pool reaching ``--sla-target`` attainment) and the
static-mean pool (see :mod:`kvflow.replay.planner_eval`).

With ``--prefill-workers``/``--decode-workers`` the offline run is
disaggregated: the live router's conditional-disaggregation rule places each
request (see :mod:`kvflow.replay.simulator`). ``--workers`` then counts extra
aggregated workers and defaults to 0 when decode workers are given (beside a
decode pool they would get nothing); with prefill workers only it keeps its
default of 8 and those aggregated workers decode.

The routing policy, its ``kv_*`` weights, the load-shedding settings
(``--shed-mode reject|queue``, ``--shed-queue-capacity``, ...) and the
disaggregation thresholds are the live router's settings: an option left
unset takes the ``KVFLOW_*`` variable ``kvflow up`` would read, else the
same default (policy ``kv``). The report counts the requests the router
shed and queued. ``--router`` is a deprecated spelling of ``--policy``, and
``--planner-ttft-statistic``, ``--planner-itl-statistic`` and
``--planner-correction-smoothing`` of ``kvflow up``'s ``--ttft-statistic``,
``--itl-statistic`` and ``--correction-smoothing``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvflow.cli_options import (
    DisaggMaxPrefillQueueOpt,
    DisaggThresholdOpt,
    JoinOptions,
    KvDiskGbOpt,
    KvHostGbOpt,
    PolicyOpt,
    ShedOptions,
    check_policy,
    deprecated_alias,
    env_help,
    option_groups,
    parse_time_ms,
    resolve_settings,
)

__all__ = ["replay"]

_Hidden = Annotated[Optional[str], typer.Option(hidden=True)]


@option_groups
def replay(
    targets: Annotated[Optional[list[str]], typer.Argument(
        help="TRACE file, or `compare` followed by JSON reports (none with --from-topics).")] = None,
    mode: Annotated[str, typer.Option(help="offline (simulated clock, no broker) | online (live deployment)")] = "offline",
    workers: Annotated[Optional[int], typer.Option(
        min=0, help="offline: simulated aggregated workers (with --planner sla: the starting pool); "
                    "default 8, or 0 when --decode-workers or --pool-workers is given")] = None,
    prefill_workers: Annotated[int, typer.Option(
        min=0, help="offline: simulated prefill-only workers (disaggregated serving)")] = 0,
    decode_workers: Annotated[int, typer.Option(
        min=0, help="offline: simulated decode workers (disaggregated serving)")] = 0,
    disagg_threshold_tokens: DisaggThresholdOpt = None,
    disagg_max_prefill_queue: DisaggMaxPrefillQueueOpt = None,
    policy: PolicyOpt = None,
    router: Annotated[Optional[str], typer.Option("--router", hidden=True, help="Deprecated: --policy.")] = None,
    kv_overlap_credit: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_overlap_credit", "offline kv/approx routing: prefill blocks saved per cached block"))]
    = None,
    kv_host_weight: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_host_weight", "offline kv/approx routing: prefill blocks saved per block cached in "
                                               "a worker's host-memory tier"))] = None,
    kv_disk_weight: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_disk_weight", "offline kv/approx routing: prefill blocks saved per block cached in "
                                               "a worker's disk tier"))] = None,
    kv_host_gb: KvHostGbOpt = None,
    kv_disk_gb: KvDiskGbOpt = None,
    num_kv_blocks: Annotated[Optional[int], typer.Option(
        min=1, help="offline: KV blocks of each simulated worker's engine memory (G1) [default: 16384]")] = None,
    kv_queue_weight: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_queue_weight", "offline kv/approx routing: weight of prompt work queued on a worker"))]
    = None,
    kv_decode_weight: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_decode_weight", "offline kv/approx routing: prefill blocks one running request "
                                                 "weighs"))] = None,
    kv_stall_weight: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_stall_weight", "offline kv/approx routing: cost per uncached prefill "
                                                "block and unit of a worker's stall exposure"))] = None,
    kv_temperature: Annotated[Optional[float], typer.Option(
        min=0, help=env_help("kv_temperature", "offline kv/approx routing: 0 = cheapest worker, > 0 = softmax "
                                               "sampling"))] = None,
    shed: ShedOptions = ShedOptions(),
    pool_workers: Annotated[Optional[str], typer.Option(
        help="offline: simulated aggregated workers per worker pool, NAME=N[,NAME=N...] (beside --workers, "
             "which join the default pool); the report gives each pool's figures")] = None,
    pool_grid: Annotated[Optional[Path], typer.Option(
        help="offline: the global router's pool grid (TOML or JSON; e.g. examples/pools.toml)")] = None,
    seed: int = 0,
    speedup: Annotated[float, typer.Option(help="divide trace inter-arrival times by this")] = 1.0,
    start_ms: Optional[float] = None,
    end_ms: Optional[float] = None,
    limit: Annotated[Optional[int], typer.Option(help="replay only the first N requests")] = None,
    rate: Annotated[Optional[float], typer.Option(help="override arrivals: Poisson at this many req/s")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="write the JSON report here")] = None,
    markdown: Annotated[Optional[Path], typer.Option(help="write the markdown report here")] = None,
    plots: Annotated[Optional[Path], typer.Option(help="write PNG plots into this directory")] = None,
    sla_ttft_ms: Annotated[float, typer.Option("--sla-ttft-ms", "--ttft-ms", help="SLA: TTFT threshold, ms")] = 500.0,
    sla_itl_ms: Annotated[float, typer.Option(
        "--sla-itl-ms", "--itl-ms", help="SLA: per-request mean ITL (TPOT) threshold, ms")] = 50.0,
    planner: Annotated[str, typer.Option(help="offline: none | sla (size the pool with the SLA planner)")] = "none",
    planner_ttft_ms: Annotated[Optional[float], typer.Option(
        help="planner: TTFT it plans for, ms (default: the SLA threshold)")] = None,
    planner_itl_ms: Annotated[Optional[float], typer.Option(
        help="planner: ITL it plans for, ms (default: the SLA threshold; with the mean statistic, lower buys "
             "tail headroom)")] = None,
    ttft_statistic: Annotated[Optional[str], typer.Option(
        help="planner: mean | p99: which statistic of an interval's TTFTs must meet its TTFT target "
             "[default: mean]")] = None,
    itl_statistic: Annotated[Optional[str], typer.Option(
        help="planner: mean | p99: which statistic of an interval's per-request ITLs must meet its ITL target "
             "[default: mean]")] = None,
    correction_smoothing: Annotated[Optional[float], typer.Option(
        help="planner: weight of the newest interval in the moving average of correction factors (1: none) "
             "[default: 1.0]")] = None,
    planner_ttft_statistic: _Hidden = None,
    planner_itl_statistic: _Hidden = None,
    planner_correction_smoothing: Annotated[Optional[float], typer.Option(hidden=True)] = None,
    predictor: Annotated[str, typer.Option(
        help="planner: constant | arima | kalman | prophet | max_recent | quantile | backtest")] = "constant",
    adjustment_interval_s: Annotated[float, typer.Option(help="planner: simulated seconds between decisions")] = 60.0,
    reactive_interval_s: Annotated[float, typer.Option(
        min=0, help="planner: simulated seconds between fast reactive checks between decisions (0: none)")] = 1.0,
    hop_ms: Annotated[Optional[float], typer.Option(
        min=0, help="offline: simulated ms of one hop through the broker (records reach their consumer that "
                    "much later; 0: at once). Default: measured from the log with --from-topics, else 0")] = None,
    worker_startup_s: Annotated[float, typer.Option(
        min=0, help="offline: simulated seconds a worker the planner starts needs before it takes requests")] = 0.0,
    scale_down_hold_intervals: Annotated[int, typer.Option(
        min=1, help="planner: intervals a lower need must last before scaling down")] = 3,
    min_workers: Annotated[int, typer.Option(
        min=0, help="planner: fewest workers (0: scale to zero; with --shed-mode queue --shed-cold-start-hold-s)")
    ] = 1,
    max_workers: Annotated[int, typer.Option(min=1, help="planner: most workers (and static-peak search cap)")] = 16,
    sla_target: Annotated[float, typer.Option(help="planner: SLA attainment the static-peak pool must reach")] = 0.99,
    profile_kind: Annotated[str, typer.Option(
        help="planner: aggregated (prefill and decode profiled together, at the trace's mean OSL) | phases "
             "(apart) | family (aggregated at OSL 16-512, blended around the observed OSL)")] = "aggregated",
    speedup_ratio: Annotated[float, typer.Option(help="offline: mocker engine speed; step times are divided by this")]
    = 1.0,
    join: JoinOptions = JoinOptions(),
    url: Annotated[Optional[str], typer.Option(help="online: an OpenAI-compatible base URL instead of Kafka")] = None,
    model: Annotated[str, typer.Option(help="online: model name to request")] = "SmolLM2-135M-Instruct",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    from_topics: Annotated[bool, typer.Option(
        help="offline: replay a running deployment's own log (its topics) instead of a trace file")] = False,
    since: Annotated[str, typer.Option(
        help="--from-topics: first request creation time (epoch ms, ISO 8601, '-10m', 'now')")] = "-1h",
    until: Annotated[str, typer.Option(help="--from-topics: end of the window, exclusive")] = "now",
    recorded_json: Annotated[Optional[Path], typer.Option(
        help="--from-topics: write the recorded run's report here (for `kvflow replay compare`)")] = None,
    save_trace: Annotated[Optional[Path], typer.Option(
        help="--from-topics: keep the rebuilt trace (kvflow JSONL) here")] = None,
) -> None:
    """Replay a traffic trace and report TTFT, ITL, throughput, goodput and prefix hit rate."""
    from kvflow.replay import compare_reports, render_markdown, run_offline, run_online

    targets = targets or []
    if from_topics:
        if targets or mode != "offline":
            raise typer.BadParameter("--from-topics replays offline and takes no trace file")
        settings = join.settings()
        recorded, trace_file, measured_hop_ms = _from_topics(settings, parse_time_ms(since), parse_time_ms(until), save_trace,
                                            sla_ttft_ms, sla_itl_ms, progress)
        if recorded_json is not None:
            from kvflow.replay.report import write_json

            write_json(recorded, recorded_json)
        typer.echo(f"recorded: {recorded.requests} requests, {recorded.workers} workers, policy {recorded.policy}, "
                   f"prefix hit rate {recorded.prefix_hit_rate:.4f}, broker hop {measured_hop_ms:.1f} ms")
        if hop_ms is None:
            hop_ms = measured_hop_ms
        targets = [str(trace_file)]
        if workers is None:
            workers = recorded.workers or 1
    elif not targets:
        raise typer.BadParameter("give a trace file, `compare a.json b.json ...`, or --from-topics")
    if targets[0] == "compare":
        if len(targets) < 2:
            raise typer.BadParameter("compare needs at least one JSON report")
        typer.echo(compare_reports(targets[1:]))
        if plots is not None:
            from kvflow.replay.plots import plot_comparison
            from kvflow.replay.report import load_report

            for path in plot_comparison([load_report(t) for t in targets[1:]], [Path(t).stem for t in targets[1:]],
                                        plots):
                typer.echo(f"wrote {path}")
        return
    if len(targets) != 1:
        raise typer.BadParameter("give one trace file (or `compare a.json b.json ...`)")
    trace = Path(targets[0])
    common = dict(start_ms=start_ms, end_ms=end_ms, limit=limit, json_path=json_path, markdown_path=markdown,
                  plot_dir=plots, progress=progress, sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms)
    if workers is None:
        workers = 0 if decode_workers or pool_workers else 8
    policy = deprecated_alias("--router", router, "--policy", policy)
    ttft_statistic = deprecated_alias("--planner-ttft-statistic", planner_ttft_statistic, "--ttft-statistic",
                                      ttft_statistic) or "mean"
    itl_statistic = deprecated_alias("--planner-itl-statistic", planner_itl_statistic, "--itl-statistic",
                                     itl_statistic) or "mean"
    correction_smoothing = deprecated_alias("--planner-correction-smoothing", planner_correction_smoothing,
                                            "--correction-smoothing", correction_smoothing)
    kv_weights = {k: v for k, v in (("kv_overlap_credit", kv_overlap_credit), ("kv_host_weight", kv_host_weight),
                                     ("kv_disk_weight", kv_disk_weight), ("kv_queue_weight", kv_queue_weight),
                                     ("kv_decode_weight", kv_decode_weight), ("kv_stall_weight", kv_stall_weight),
                                     ("kv_temperature", kv_temperature))
                  if v is not None}
    shedding = shed.given()
    if mode == "offline":
        from kvflow.router.disagg import DisaggConfig
        from kvflow.router.kv_policy import KvPolicyConfig
        from kvflow.router.pools import load_pool_grid
        from kvflow.router.shedding import ShedConfig
        from kvflow.workers.engines.mocker_core import MockerConfig

        geometry = {}
        if from_topics and recorded.block_size is not None:
            # The simulated workers get the recorded workers' KV geometry, so blocks hash and evict alike.
            geometry = {"block_size": recorded.block_size,
                        **({"num_kv_blocks": recorded.total_kv_blocks // max(recorded.workers, 1)}
                           if recorded.total_kv_blocks else {})}

        # The live router's settings, so the simulation routes as `kvflow up` would in this environment.
        settings = resolve_settings(routing_policy=policy, disagg_prefill_threshold_tokens=disagg_threshold_tokens,
                                    disagg_max_prefill_queue_per_worker=disagg_max_prefill_queue, **kv_weights,
                                    **shedding, **({"kv_host_gb": kv_host_gb} if kv_host_gb is not None else {}),
                                    **({"kv_disk_gb": kv_disk_gb} if kv_disk_gb is not None else {}))
        check_policy(settings.routing_policy)
        try:
            plan = _planner_options(planner, sla_ttft_ms if planner_ttft_ms is None else planner_ttft_ms,
                                    sla_itl_ms if planner_itl_ms is None else planner_itl_ms, predictor,
                                    adjustment_interval_s, scale_down_hold_intervals, min_workers, max_workers,
                                    workers, sla_target, profile_kind, ttft_statistic=ttft_statistic,
                                    itl_statistic=itl_statistic,
                                    correction_smoothing=1.0 if correction_smoothing is None else correction_smoothing,
                                    worker_startup_s=worker_startup_s,
                                    pools=bool(pool_workers or prefill_workers or decode_workers))
            report = run_offline(trace, workers=workers, policy=settings.routing_policy, seed=seed, speedup=speedup,
                                 rate=rate, mocker_config=MockerConfig(
                                     speedup_ratio=speedup_ratio, kv_host_bytes=int(settings.kv_host_gb * (1 << 30)),
                                     kv_disk_bytes=int(settings.kv_disk_gb * (1 << 30)),
                                     **{**geometry, **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {})}),
                                 prefill_workers=prefill_workers, decode_workers=decode_workers,
                                 disagg=DisaggConfig.from_settings(settings),
                                 worker_startup_ms=worker_startup_s * 1000.0,
                                 kv_config=KvPolicyConfig.from_settings(settings),
                                 shed=ShedConfig.from_settings(settings),
                                 reactive_interval_s=reactive_interval_s or None,
                                 pool_workers=_pool_counts(pool_workers),
                                 pool_grid=load_pool_grid(pool_grid) if pool_grid else None,
                                 hop_ms=hop_ms or 0.0, **plan, **common)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    elif mode == "online":
        if planner != "none":
            raise typer.BadParameter("--planner runs in offline mode only (online, run `kvflow up --planner sla`)")
        if shedding:
            raise typer.BadParameter("--shed-* options configure the offline simulator's router; online, the "
                                     "deployment's router reads them from its settings (`kvflow up --shed-mode ...`)")
        if kv_weights:
            raise typer.BadParameter("--kv-* weights configure the offline simulator's router; online, the "
                                     "deployment's router reads them from its settings (KVFLOW_KV_DECODE_WEIGHT, ...)")
        if kv_host_gb is not None or kv_disk_gb is not None or num_kv_blocks is not None:
            raise typer.BadParameter("--kv-host-gb/--kv-disk-gb/--num-kv-blocks size the offline simulation's "
                                     "engines; online, the deployment's workers have theirs (`kvflow up "
                                     "--kv-host-gb ...`)")
        if prefill_workers or decode_workers or pool_workers or pool_grid:
            raise typer.BadParameter("--prefill-workers/--decode-workers/--pool-workers/--pool-grid shape the "
                                     "offline simulation; online, the deployment's own workers and router serve "
                                     "(`kvflow up --prefill-workers ...`, KVFLOW_WORKER_POOL, "
                                     "KVFLOW_ROUTER_POOL_GRID)")
        if policy is not None:
            raise typer.BadParameter("--policy configures the offline simulator's router; online, the deployment's "
                                     "router routes (`kvflow up --policy ...`)")

        settings = None if url else join.settings()
        report = run_online(trace, settings, url=url, model=model, speedup=speedup, rate=rate, seed=seed, **common)
    else:
        raise typer.BadParameter("--mode must be offline or online")
    typer.echo(render_markdown(report))
    if from_topics:
        from kvflow.replay.compare import compare

        labels = ["recorded", f"replayed ({report.policy})"]
        typer.echo(compare([recorded, report], labels))
        if plots is not None:
            from kvflow.replay.plots import plot_comparison

            for path in plot_comparison([recorded, report], labels, plots):
                typer.echo(f"wrote {path}")


def _from_topics(settings, since_ms: int, until_ms: int, save_trace: Path | None, sla_ttft_ms: float,
                 sla_itl_ms: float, progress: bool = True):
    """Read the deployment's log for ``[since_ms, until_ms)``: the recorded run's
    report, the trace file it was rebuilt into (``save_trace``, else a temporary file)
    and the broker hop measured on it (ms, :meth:`~kvflow.replay.from_log.RecordedRun.hop_ms`).

    Raises:
        typer.BadParameter: no request was created in the window.
    """
    import asyncio
    import atexit
    import shutil
    import tempfile

    from kvflow.replay.from_log import read_recorded, recorded_report, write_trace

    run = asyncio.run(read_recorded(settings, since_ms, until_ms, progress=progress))
    if not run.requests:
        raise typer.BadParameter(f"no request was created in [{since_ms}, {until_ms}) on namespace "
                                 f"{settings.namespace}")
    if save_trace is None:
        scratch = tempfile.mkdtemp(prefix="kvflow-replay-")
        atexit.register(shutil.rmtree, scratch, True)  # the rebuilt trace is only kept when asked for
        path = Path(scratch) / "topics.jsonl"
    else:
        path = save_trace
    write_trace(run, path)
    return recorded_report(run, trace=f"topics[{since_ms},{until_ms})", sla_ttft_ms=sla_ttft_ms,
                           sla_itl_ms=sla_itl_ms), path, run.hop_ms()


def _pool_counts(spec: str | None) -> dict[str, int]:
    """``NAME=N,NAME=N`` → ``{NAME: N}`` (``--pool-workers``).

    Raises:
        ValueError: an entry without ``=``, or a count that is not an integer >= 0.
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        name, sep, count = part.partition("=")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"--pool-workers takes NAME=N entries, not {part!r}")
        out[name.strip()] = int(count)
    return out


def _planner_options(planner: str, ttft_ms: float, itl_ms: float, predictor: str, interval_s: float, hold: int,
                     min_workers: int, max_workers: int, workers: int, sla_target: float,
                     profile_kind: str, **tuning) -> dict:
    """``run_offline`` keyword arguments for ``--planner`` (empty for ``none``);
    ``tuning`` holds further :class:`~kvflow.planner.core.PlannerConfig` fields.

    Raises:
        ValueError: unknown planner or profile kind, ``--workers`` outside
            ``[--min-workers, --max-workers]`` (0 is fine beside worker pools or
            prefill/decode workers, ``tuning["pools"]``), or invalid planner settings.
    """
    if planner == "none":
        return {}
    if planner != "sla":
        raise ValueError(f"--planner must be none or sla, not {planner!r}")
    if not min_workers <= workers <= max_workers and not (workers == 0 and tuning.pop("pools", False)):
        raise ValueError(f"--workers {workers} (the starting pool) must lie in [{min_workers}, {max_workers}]")
    tuning.pop("pools", None)
    from kvflow.planner.core import PlannerConfig, PlannerMode

    config = PlannerConfig(ttft_ms=ttft_ms, itl_ms=itl_ms, adjustment_interval_s=interval_s,
                           mode=PlannerMode.aggregated, predictor=predictor, min_aggregated_replicas=min_workers,
                           max_gpus=max_workers, scale_down_hold_intervals=hold, **tuning)
    return {"planner": config, "max_workers": max_workers, "sla_target": sla_target, "profile_kind": profile_kind}
