"""PNG plots of a replay: latency CDFs, load / hit rate over time and, with the
SLA planner, load, prediction and replicas over time (matplotlib, Agg backend)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from kvflow.replay.report import Report, RequestRecord

__all__ = ["latency_samples", "plot_latency_cdfs", "plot_timeline", "plot_planner", "write_plots",
           "plot_comparison"]

_CDF_POINTS = 2000  # a CDF drawn from this many quantiles looks the same as from millions of points


def latency_samples(records: Sequence[RequestRecord],
                    itl_gaps_ms: Sequence[float] | np.ndarray) -> dict[str, np.ndarray]:
    """Raw latency samples (ms) of completed requests: ``ttft``, ``itl`` (pooled gaps), ``e2e``."""
    done = [r for r in records if r.ok]
    return {
        "ttft": np.array([r.first_token_ms - r.arrival_ms for r in done if r.first_token_ms is not None]),
        "itl": np.asarray(itl_gaps_ms, dtype=np.float64),
        "e2e": np.array([r.finish_ms - r.arrival_ms for r in done]),
    }


def _ragged(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows of per-worker values → 2-D array padded with NaN (workers may join mid-run)."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), np.nan)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in headless runs and threads
    import matplotlib.pyplot as plt

    return plt



def plot_latency_cdfs(samples: Mapping[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """One panel per sample (TTFT, ITL, e2e): empirical CDF on a log-x axis. Returns ``path``."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    names = [k for k in ("ttft", "itl", "e2e") if k in samples]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        data = np.asarray(samples[name], dtype=np.float64)
        if data.size:
            q = np.linspace(0.0, 1.0, min(_CDF_POINTS, data.size))
            xs = np.quantile(data, q)
            ax.plot(np.maximum(xs, 1e-3), q)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            for p in (0.5, 0.9, 0.99):
                ax.axhline(p, color="0.85", lw=0.8, zorder=0)
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.set_ylim(0, 1)
        ax.set_title(f"{name.upper()} CDF (n={data.size:,})")
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_timeline(report: Report, path: str | Path) -> Path:
    """Per-worker in-flight requests and KV usage over time, with the prefix hit
    rate of each interval, from ``report.timeline``. Returns ``path``."""
    plt = _pyplot()
    pts = report.timeline
    fig, (ax_load, ax_kv) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if pts:
        t = np.array([p.t_s for p in pts])
        load = _ragged([p.load for p in pts])
        kv = _ragged([p.kv_usage for p in pts]) * 100
        # Mean over workers with a min–max band: readable at any worker count.
        for ax, data, color in ((ax_load, load, "tab:blue"), (ax_kv, kv, "tab:green")):
            if data.ndim != 2 or data.shape[1] == 0:
                continue  # not observed (online replay has no KV usage)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns before a worker existed
                lo, hi, mean = np.nanmin(data, axis=1), np.nanmax(data, axis=1), np.nanmean(data, axis=1)
            ax.fill_between(t, lo, hi, color=color, alpha=0.2, lw=0, label="min–max over workers")
            ax.plot(t, mean, color=color, lw=1.2, label="mean over workers")
            ax.legend(loc="upper left", fontsize=8)
        hit = np.array([np.nan if p.hit_rate is None else p.hit_rate * 100 for p in pts])
        ax_hit = ax_load.twinx()
        ax_hit.plot(t, hit, color="black", lw=1.2, ls="--", label="prefix hit rate")
        ax_hit.set_ylabel("prefix hit rate (%)")
        ax_hit.set_ylim(0, 100)
        ax_hit.legend(loc="upper right", fontsize=8)
    ax_load.set_ylabel("in-flight requests" if report.mode == "offline" else "in flight (all workers)")
    ax_load.set_title(f"{report.trace}: load per worker ({report.policy}, {report.workers} workers)")
    ax_kv.set_ylabel("KV blocks used (%)")
    ax_kv.set_xlabel("time (s)")
    return _save(plt, fig, path)


def plot_planner(report: Report, path: str | Path) -> Path:
    """SLA planner run over simulated time, from ``report.planner``. Returns ``path``.

    Top: arrivals per second (timeline bins), the request rate each tick
    observed (finished requests over the interval before it) and the rate it
    predicted for the interval after it. Bottom: serving and live (serving +
    draining) workers, with the static-peak and static-mean pools as lines.

    Raises:
        ValueError: the report has no planner summary.
    """
    if report.planner is None:
        raise ValueError("report has no planner summary")
    plt = _pyplot()
    pl = report.planner
    fig, (ax_load, ax_rep) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    pts = report.timeline
    if len(pts) > 1:
        t = np.array([p.t_s for p in pts])
        bins = np.diff(np.concatenate([[0.0], t]))
        arrivals = np.array([p.arrivals for p in pts]) / np.where(bins > 0, bins, np.nan)
        ax_load.step(t, arrivals, where="pre", color="0.7", lw=0.8, label="arrivals (req/s)")
    if pl.ticks:
        interval = pl.settings.get("adjustment_interval_s", 0.0)
        t_tick = np.array([k.t_s for k in pl.ticks])
        # The observation covers [t - interval, t); the prediction covers [t, t + interval).
        ax_load.step(np.append(t_tick - interval, t_tick[-1]), np.append([k.observed_rate_per_s for k in pl.ticks],
                     pl.ticks[-1].observed_rate_per_s), where="post", color="tab:blue", lw=1.4,
                     label="observed (finished req/s)")
        ax_load.step(np.append(t_tick, t_tick[-1] + interval), np.append([k.predicted_rate_per_s for k in pl.ticks],
                     pl.ticks[-1].predicted_rate_per_s), where="post", color="tab:orange", lw=1.4, ls="--",
                     label=f"predicted ({pl.settings.get('predictor', '?')})")
    ax_load.set_ylabel("requests/s")
    ax_load.legend(loc="upper left", fontsize=8)
    ax_load.set_title(f"{report.trace}: SLA planner (TTFT ≤ {report.goodput.sla_ttft_ms:g} ms, "
                      f"ITL ≤ {report.goodput.sla_itl_ms:g} ms)")
    if pl.replicas:
        t_rep = [s.t_s for s in pl.replicas] + [report.duration_s]
        ax_rep.step(t_rep, [s.live for s in pl.replicas] + [pl.replicas[-1].live], where="post", color="tab:red",
                    lw=1.4, label=f"live workers ({report.replica_hours or 0:.2f} replica-h, "
                                  f"SLA {report.sla_attainment or 0:.2%})")
        ax_rep.step(t_rep, [s.serving for s in pl.replicas] + [pl.replicas[-1].serving], where="post",
                    color="tab:green", lw=1.0, ls="--", label="serving workers")
    for n, hours, sla, style, name in (
            (pl.static_peak_replicas, report.static_peak_replica_hours, report.static_peak_sla_attainment, ":",
             "static peak"),
            (pl.static_mean_replicas, report.static_mean_replica_hours, report.static_mean_sla_attainment, "-.",
             "static mean")):
        ax_rep.axhline(n, color="0.4", ls=style, lw=1.0,
                       label=f"{name}: {n} ({hours or 0:.2f} replica-h, SLA {sla or 0:.2%})")
    ax_rep.set_ylabel("workers")
    ax_rep.set_xlabel("time (s)")
    ax_rep.set_ylim(bottom=0)
    ax_rep.legend(loc="upper left", fontsize=8)
    return _save(plt, fig, path)


def write_plots(report: Report, samples: Mapping[str, np.ndarray], out_dir: str | Path) -> list[Path]:
    """Write ``latency_cdf.png`` and ``timeline.png`` into ``out_dir`` (plus
    ``planner.png`` when the report has a planner summary); returns their paths."""
    out = Path(out_dir)
    title = f"{report.trace} — {report.policy}, {report.workers} workers"
    paths = [plot_latency_cdfs(samples, out / "latency_cdf.png", title), plot_timeline(report, out / "timeline.png")]
    if report.planner is not None:
        paths.append(plot_planner(report, out / "planner.png"))
    return paths


def plot_comparison(reports: Sequence[Report], labels: Sequence[str], out_dir: str | Path) -> list[Path]:
    """Write ``compare_cdf.png`` (TTFT, ITL and e2e CDFs of every report, from
    their ``quantiles_ms``) and ``compare_load.png`` (prefix hit rate per report,
    and requests per worker) into ``out_dir``; returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    names = ("ttft", "itl", "e2e")
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    q = np.linspace(0.0, 1.0, 101)
    for ax, name in zip(axes[0], names, strict=True):
        for report, label in zip(reports, labels, strict=True):
            xs = report.quantiles_ms.get(name)
            if xs:
                ax.plot(np.maximum(np.asarray(xs), 1e-3), q, label=label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.set_ylim(0, 1)
        ax.set_title(f"{name.upper()} CDF")
        ax.legend(fontsize=8)
    paths = [_save(plt, fig, out / "compare_cdf.png")]

    fig, (ax_hit, ax_load) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax_hit.bar(range(len(reports)), [r.prefix_hit_rate * 100 for r in reports], color="tab:blue")
    ax_hit.set_xticks(range(len(reports)), labels, fontsize=8)
    ax_hit.set_ylabel("prefix hit rate (%)")
    ax_hit.set_ylim(0, 100)
    ax_hit.set_title("prefix hit rate")
    width = 0.8 / max(len(reports), 1)
    for i, (report, label) in enumerate(zip(reports, labels, strict=True)):
        counts = sorted((w.requests for w in report.per_worker), reverse=True)  # ids differ between runs
        ax_load.bar(np.arange(len(counts)) + i * width, counts, width, label=label)
    most = max((len(r.per_worker) for r in reports), default=0)
    ax_load.set_xticks(np.arange(most) + width * (len(reports) - 1) / 2, [f"#{i + 1}" for i in range(most)])
    ax_load.set_xlabel("workers, busiest first")
    ax_load.set_ylabel("requests")
    ax_load.set_title("requests per worker")
    ax_load.legend(fontsize=8)
    paths.append(_save(plt, fig, out / "compare_load.png"))
    return paths


def _save(plt, fig, path: str | Path) -> Path:
    """Lay out ``fig``, write it as PNG to ``path`` (parents created), close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
