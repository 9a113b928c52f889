"""``run_offline``: trace file → simulation → report (JSON, markdown, plots).

With a :class:`~kvflow.planner.core.PlannerConfig` the SLA planner sizes the
pool during the run, and the same trace is also run on the static-peak and
static-mean pools (:mod:`kvflow.replay.planner_eval`). With prefill or decode
workers the run is disaggregated (see :mod:`kvflow.replay.simulator`) and the
report carries a :class:`~kvflow.replay.report.DisaggSummary`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvflow.planner.core import PlannerConfig, PlannerMode
from kvflow.planner.interpolation import perf_source
from kvflow.planner.profile import Profile
from kvflow.replay.compare import compare_reports
from kvflow.replay.planner_eval import evaluate_planner, profile_for, replica_hours, worker_lifetimes
from kvflow.replay.plots import latency_samples, write_plots
from kvflow.replay.pool_planner import run_pool_planner
from kvflow.replay.pool_report import pool_report
from kvflow.replay.report import Report, RequestRecord, build_report, disagg_summary, render_markdown, write_json
from kvflow.replay.simulator import KvEventHook, SimConfig, SimResult, simulate
from kvflow.replay.traces import Trace, read_trace
from kvflow.router.disagg import DisaggConfig
from kvflow.router.kv_policy import KvPolicyConfig
from kvflow.router.pools import PoolGrid
from kvflow.router.shedding import ShedConfig
from kvflow.schemas import WorkerRole
from kvflow.workers.engines.mocker_core import MockerConfig

__all__ = ["run_offline", "write_outputs", "compare_reports"]


def write_outputs(report: Report, records: Sequence[RequestRecord], itl_gaps_ms: Sequence[float] | np.ndarray, *,
                  json_path: str | Path | None = None, markdown_path: str | Path | None = None,
                  plot_dir: str | Path | None = None) -> None:
    """Write whichever of the JSON report, markdown summary and PNG plots were asked for."""
    if json_path is not None:
        write_json(report, json_path)
    if markdown_path is not None:
        path = Path(markdown_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_markdown(report), encoding="utf-8")
    if plot_dir is not None:
        write_plots(report, latency_samples(records, itl_gaps_ms), plot_dir)


def _options(trace: Trace, config: SimConfig, res: SimResult) -> dict:
    """The report's ``options``: the trace's, the kv weights when set, the shedding settings,
    and the run's step counts, router counters and profile."""
    kv = {} if config.kv is None else {"kv_weights": dataclasses.asdict(config.kv)}
    shed = {k: v.value if hasattr(v, "value") else v for k, v in dataclasses.asdict(config.shed).items()}
    return {**trace.options, **kv, "shed": shed, "engine_steps": res.steps, "stalled_steps": res.stalls,
            "router": res.router_counts, "hop_ms": config.hop_ms, "profile_s": {k: round(v, 3) for k, v in res.profile_s.items()}}


def _router_counts(res: SimResult) -> dict:
    """``build_report``'s ``shed`` and ``queued`` from the router core's counters."""
    return {"shed": res.router_counts.get("shed", 0), "queued": res.router_counts.get("queued", 0)}


def _tier_fields(res: SimResult) -> dict:
    """The report's KV-tier fields (``recomputed_prefill_tokens``, ``tier_hit_rates``, ``kv_tiers``)."""
    n = res.tier_prompt_tokens
    rates = {t: (c / n if n else 0.0) for t, c in res.tier_cached_tokens.items()}
    return {"recomputed_prefill_tokens": res.recomputed_prefill_tokens, "tier_hit_rates": rates,
            "kv_tiers": {k: round(v, 3) for k, v in res.tier_counters.items()} or None}


def run_offline(
    trace_path: str | Path,
    workers: int = 8,
    policy: str = "round_robin",
    seed: int = 0,
    mocker_config: MockerConfig | None = None,
    speedup: float = 1.0,
    start_ms: float | None = None,
    end_ms: float | None = None,
    limit: int | None = None,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    plot_dir: str | Path | None = None,
    progress: bool = True,
    sla_ttft_ms: float = 500.0,
    sla_itl_ms: float = 50.0,
    *,
    rate: float | None = None,
    kv_hook: KvEventHook | None = None,
    sample_interval_ms: float = 10_000.0,
    planner: PlannerConfig | None = None,
    max_workers: int = 16,
    sla_target: float = 0.99,
    profile: Profile | list[Profile] | None = None,
    profile_kind: str = "aggregated",
    prefill_workers: int = 0,
    decode_workers: int = 0,
    disagg: DisaggConfig | None = None,
    worker_startup_ms: float = 0.0,
    kv_config: KvPolicyConfig | None = None,
    shed: ShedConfig | None = None,
    reactive_interval_s: float | None = 1.0,
    pool_workers: dict[str, int] | None = None,
    pool_grid: PoolGrid | None = None,
    hop_ms: float = 0.0,
) -> Report:
    """Replay a trace file through the offline simulator and summarise it.

    Args:
        trace_path: any format of :mod:`kvflow.replay.traces`.
        workers: simulated aggregated workers (0 allowed with ``decode_workers``).
        policy: routing policy name.
        seed: seeds synthetic prompts, Poisson arrivals and engine outputs;
            equal inputs and seed give an identical report (``wall_time_s``
            and ``options["profile_s"]`` aside).
        mocker_config: engine settings per worker (default :class:`MockerConfig`).
        speedup, start_ms, end_ms, limit, rate: trace options (:func:`read_trace`).
        json_path, markdown_path, plot_dir: outputs to write (none by default).
        progress: progress bar on a TTY.
        sla_ttft_ms, sla_itl_ms: goodput thresholds.
        kv_hook: receives every step's KV events (for a KV index).
        sample_interval_ms: timeline resolution in simulated ms.
        planner: run the SLA planner (aggregated mode); ``workers`` is then
            the starting pool. Its TTFT/ITL targets are the mean latencies it
            plans for; attainment is judged at ``sla_ttft_ms``/``sla_itl_ms``.
            The report describes the planner run and adds the static-peak and
            static-mean baselines (:func:`~kvflow.replay.planner_eval.evaluate_planner`).
            With worker pools (``pool_workers``) or prefill/decode workers,
            one planner per pool sizes it from its own load instead
            (:func:`~kvflow.replay.pool_planner.run_pool_planner`: every pool
            with ``planner``'s settings; disaggregated, its minimum applies to
            the prefill and the decode pool); the report's ``pools`` then add
            each pool's planner figures, and no static baseline is run.
        max_workers: with ``planner``: upper end of the static-peak search
            (set ``planner.max_gpus`` to cap the planner itself).
        sla_target: with ``planner``: SLA attainment the static-peak pool must reach.
        profile: with ``planner``: the profile to plan with; default: the
            mocker with ``mocker_config`` profiled as ``profile_kind``
            (:func:`~kvflow.replay.planner_eval.profile_for`; the aggregated
            kind uses the trace's mean OSL).
        profile_kind: ``aggregated``, ``phases`` or ``family`` (see ``profile``;
            :data:`~kvflow.replay.planner_eval.PROFILE_KINDS`).
        prefill_workers, decode_workers: simulated prefill-only and decode
            workers; either > 0 makes the run disaggregated (the live
            router's :func:`kvflow.router.disagg.place` rule). Aggregated
            workers beside decode workers receive nothing (that rule decodes
            on the decode pool); beside prefill workers only, they are the
            decode targets.
        disagg: the rule's thresholds (default :class:`DisaggConfig`).
        reactive_interval_s: with ``planner``: simulated seconds between the
            planner's fast-path checks (None: interval ticks only).
        worker_startup_ms: simulated ms before a worker the planner starts
            takes requests (its replica-hours count from its start).
        kv_config: weights of the ``kv``/``approx`` cost (default: the
            policy defaults); recorded in the report's ``options["kv_weights"]``.
        shed: the router's load shedding and queue (default
            :class:`~kvflow.router.shedding.ShedConfig`, the live defaults);
            recorded in ``options["shed"]``; the report's ``shed`` and
            ``queued`` count what it did.
        pool_workers: aggregated workers per worker pool, beside ``workers``
            (the default pool); the report's ``pools`` gives each pool's figures.
        pool_grid: the global router's pool grid (:mod:`kvflow.router.pools`).
        hop_ms: simulated ms of one broker hop (:class:`SimConfig`); recorded
            in ``options["hop_ms"]``.

    Returns:
        The :class:`Report`.

    Raises:
        TraceFormatError: malformed trace. KeyError: unknown policy.
        FileNotFoundError: no trace file.
        ValueError: a planner setting is invalid (see ``evaluate_planner``),
            ``kv_hook`` was given with ``planner``, or the worker counts are invalid.
    """
    trace = read_trace(trace_path, speedup=speedup, start_ms=start_ms, end_ms=end_ms, limit=limit, rate=rate,
                       seed=seed)
    mocker = mocker_config or MockerConfig()
    disagg = disagg or DisaggConfig()
    config = SimConfig(workers=workers, policy=policy, seed=seed, mocker=mocker,
                       sample_interval_ms=sample_interval_ms, prefill_workers=prefill_workers,
                       decode_workers=decode_workers, disagg=disagg, worker_startup_ms=worker_startup_ms,
                       kv=kv_config, shed=shed or ShedConfig(), pool_workers=dict(pool_workers or {}),
                       pool_grid=pool_grid, hop_ms=hop_ms)
    if planner is not None:
        if kv_hook is not None:
            raise ValueError("kv_hook is not supported together with the planner")
        if prefill_workers or decode_workers or pool_workers:
            return _run_pool_planners(trace, config, planner, sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms,
                                      profile=profile, profile_kind=profile_kind, json_path=json_path,
                                      markdown_path=markdown_path, plot_dir=plot_dir,
                                      reactive_interval_s=reactive_interval_s)
        return _run_offline_planner(trace, config, planner, max_workers=max_workers, sla_target=sla_target,
                                    sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms, profile=profile,
                                    profile_kind=profile_kind, progress=progress, json_path=json_path,
                                    markdown_path=markdown_path, plot_dir=plot_dir,
                                    reactive_interval_s=reactive_interval_s)
    res = simulate(trace, config, kv_hook=kv_hook, progress=progress)
    report = build_report(
        res.records, res.itl_gaps_ms, mode="offline", trace=trace.name, trace_format=trace.format, policy=policy,
        workers=res.worker_ids, seed=seed, sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms,
        block_size=mocker.block_size, total_kv_blocks=mocker.num_kv_blocks * len(res.worker_ids),
        busy_ms=res.busy_ms, timeline=res.timeline, wall_time_s=res.wall_time_s,
        options=_options(trace, config, res), **_router_counts(res),
    )
    hours = replica_hours(worker_lifetimes(res.records, res.worker_ids, res.end_ms))
    report = report.model_copy(update={"replica_hours": hours, **_tier_fields(res)})
    if pool_workers:
        report = report.model_copy(update={"pools": pool_report(res.records, res.worker_pools)})
    if res.disaggregated:
        summary = disagg_summary(
            res.records, worker_roles=res.worker_roles, busy_ms=res.busy_ms, duration_ms=report.duration_s * 1000.0,
            prefill_tokens=res.prefill_tokens, decode_tokens=res.decode_tokens, prefill_plans=res.prefill_plans,
            prefill_threshold_tokens=disagg.prefill_threshold_tokens,
            max_prefill_queue_per_worker=disagg.max_prefill_queue_per_worker)
        report = report.model_copy(update={
            "disagg": summary,
            "options": {**report.options, "prefill_workers": prefill_workers, "decode_workers": decode_workers,
                        "aggregated_workers": workers}})
    write_outputs(report, res.records, res.itl_gaps_ms, json_path=json_path, markdown_path=markdown_path,
                  plot_dir=plot_dir)
    return report


def _run_pool_planners(trace: Trace, config: SimConfig, planner: PlannerConfig, *, sla_ttft_ms: float,
                       sla_itl_ms: float, profile: Profile | list[Profile] | None, profile_kind: str,
                       json_path: str | Path | None, markdown_path: str | Path | None, plot_dir: str | Path | None,
                       reactive_interval_s: float | None) -> Report:
    """The planner branch of :func:`run_offline` for worker pools or a disaggregated run:
    one planner per pool (:func:`~kvflow.replay.pool_planner.run_pool_planner`), each
    starting from the pool's configured workers."""
    t_start = time.perf_counter()
    mocker = dataclasses.replace(config.mocker or MockerConfig(), seed=config.seed)
    if profile is None:
        osl = float(np.mean([r.osl for r in trace.requests])) if trace.requests else 256.0
        profile = profile_for(mocker, profile_kind, osl=max(2.0, osl))
    if config.prefill_workers or config.decode_workers:
        lo = planner.min_aggregated_replicas
        configs = {"": dataclasses.replace(planner, mode=PlannerMode.disaggregated, min_prefill_replicas=lo,
                                           min_decode_replicas=lo)}
        initial = {"": {WorkerRole.prefill: config.prefill_workers, WorkerRole.decode: config.decode_workers}}
    else:
        initial = {pool: {WorkerRole.aggregated: n} for pool, n in config.pool_workers.items()}
        if config.workers:
            initial[""] = {WorkerRole.aggregated: config.workers}
        configs = {pool: planner for pool in initial}
    sim = dataclasses.replace(config, workers=0, prefill_workers=0, decode_workers=0, pool_workers={})
    perf = perf_source(profile, ttft_statistic=planner.ttft_statistic, itl_statistic=planner.itl_statistic)
    run = run_pool_planner(trace, sim, configs, perf, initial=initial,
                           sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms, fast_interval_s=reactive_interval_s)
    res = run.result
    report = build_report(
        res.records, res.itl_gaps_ms, mode="offline", trace=trace.name, trace_format=trace.format,
        policy=config.policy, workers=res.worker_ids, seed=config.seed, sla_ttft_ms=sla_ttft_ms,
        sla_itl_ms=sla_itl_ms, block_size=mocker.block_size,
        total_kv_blocks=mocker.num_kv_blocks * len(res.worker_ids), busy_ms=res.busy_ms, timeline=res.timeline,
        wall_time_s=time.perf_counter() - t_start, options=_options(trace, config, res), **_router_counts(res),
    )
    served = pool_report(res.records, res.worker_pools)
    pools = {name: {**served.get(name, {}), "planner": figures.as_dict()} for name, figures in run.pools.items()}
    report = report.model_copy(update={"replica_hours": run.replica_hours, "pools": pools, **_tier_fields(res)})
    write_outputs(report, res.records, res.itl_gaps_ms, json_path=json_path, markdown_path=markdown_path,
                  plot_dir=plot_dir)
    return report


def _run_offline_planner(trace: Trace, config: SimConfig, planner: PlannerConfig, *, max_workers: int,
                         sla_target: float, sla_ttft_ms: float, sla_itl_ms: float,
                         profile: Profile | list[Profile] | None,
                         profile_kind: str, progress: bool, json_path: str | Path | None,
                         markdown_path: str | Path | None, plot_dir: str | Path | None,
                         reactive_interval_s: float | None = 1.0) -> Report:
    """The planner branch of :func:`run_offline`: evaluate, then report on the planner run.
    ``wall_time_s`` covers profiling, the planner run and the static runs."""
    t_start = time.perf_counter()
    ev = evaluate_planner(trace, config, planner, max_replicas=max_workers, sla_ttft_ms=sla_ttft_ms,
                          sla_itl_ms=sla_itl_ms, sla_target=sla_target, profile=profile, profile_kind=profile_kind,
                          progress=progress, fast_interval_s=reactive_interval_s)
    res, mocker = ev.planner.result, config.mocker or MockerConfig()
    report = build_report(
        res.records, res.itl_gaps_ms, mode="offline", trace=trace.name, trace_format=trace.format,
        policy=config.policy, workers=res.worker_ids, seed=config.seed, sla_ttft_ms=sla_ttft_ms,
        sla_itl_ms=sla_itl_ms, block_size=mocker.block_size,
        total_kv_blocks=mocker.num_kv_blocks * len(res.worker_ids), busy_ms=res.busy_ms, timeline=res.timeline,
        wall_time_s=time.perf_counter() - t_start,
        options=_options(trace, config, res), **_router_counts(res),
    )
    report = report.model_copy(update={
        "replica_hours": ev.planner.replica_hours,
        "static_peak_replica_hours": ev.static_peak.replica_hours,
        "static_mean_replica_hours": ev.static_mean.replica_hours,
        "static_peak_sla_attainment": ev.static_peak.sla_attainment,
        "static_mean_sla_attainment": ev.static_mean.sla_attainment,
        "planner": ev.summary,
        **_tier_fields(res),
    })
    write_outputs(report, res.records, res.itl_gaps_ms, json_path=json_path, markdown_path=markdown_path,
                  plot_dir=plot_dir)
    return report
