"""``run_offline``: trace file → simulation → report (JSON, markdown, plots)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvflow.replay.compare import compare_reports
from kvflow.replay.plots import latency_samples, write_plots
from kvflow.replay.report import Report, RequestRecord, build_report, render_markdown, write_json
from kvflow.replay.simulator import KvEventHook, SimConfig, simulate
from kvflow.replay.traces import read_trace
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
) -> Report:
    """Replay a trace file through the offline simulator and summarise it.

    Args:
        trace_path: any format of :mod:`kvflow.replay.traces`.
        workers: simulated aggregated workers.
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

    Returns:
        The :class:`Report`.

    Raises:
        TraceFormatError: malformed trace. KeyError: unknown policy.
        FileNotFoundError: no trace file.
    """
    trace = read_trace(trace_path, speedup=speedup, start_ms=start_ms, end_ms=end_ms, limit=limit, rate=rate,
                       seed=seed)
    mocker = mocker_config or MockerConfig()
    config = SimConfig(workers=workers, policy=policy, seed=seed, mocker=mocker,
                       sample_interval_ms=sample_interval_ms)
    res = simulate(trace, config, kv_hook=kv_hook, progress=progress)
    report = build_report(
        res.records, res.itl_gaps_ms, mode="offline", trace=trace.name, trace_format=trace.format, policy=policy,
        workers=res.worker_ids, seed=seed, sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms,
        block_size=mocker.block_size, total_kv_blocks=mocker.num_kv_blocks * len(res.worker_ids),
        busy_ms=res.busy_ms, timeline=res.timeline, wall_time_s=res.wall_time_s,
        options={**trace.options, "engine_steps": res.steps, "stalled_steps": res.stalls,
                 "profile_s": {k: round(v, 3) for k, v in res.profile_s.items()}},
    )
    write_outputs(report, res.records, res.itl_gaps_ms, json_path=json_path, markdown_path=markdown_path,
                  plot_dir=plot_dir)
    return report
