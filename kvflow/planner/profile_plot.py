"""A PNG of a :class:`~kvflow.planner.profile.Profile` (matplotlib, Agg backend).

Four panels, one line per profiled concurrency: TTFT vs ISL, prefill
throughput vs ISL, ITL vs context length, decode throughput vs context
length. Infeasible cells (``None``) leave gaps.
"""

from __future__ import annotations

from pathlib import Path

from kvflow.planner.profile import Profile

__all__ = ["plot_profile"]


def plot_profile(profile: Profile, path: str | Path) -> Path:
    """Draw ``profile`` to ``path`` (PNG; parents created); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in headless runs
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    p, d = profile.prefill, profile.decode
    panels = [
        (p.isl, p.concurrency, p.ttft_ms, "ISL (tokens)", "TTFT (ms)"),
        (p.isl, p.concurrency, p.throughput_tokens_per_s, "ISL (tokens)", "prefill tokens/s per replica"),
        (d.context_length, d.concurrency, d.itl_ms, "context length (tokens)", "ITL (ms)"),
        (d.context_length, d.concurrency, d.throughput_tokens_per_s, "context length (tokens)",
         "decode tokens/s per replica"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, (xs, concs, grid, xlabel, ylabel) in zip(axes.ravel(), panels, strict=True):
        for j, c in enumerate(concs):
            ys = [float("nan") if row[j] is None else row[j] for row in grid]
            ax.plot(xs, ys, marker="o", markersize=3, label=f"c={c}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(title="concurrency", fontsize="small")
    fig.suptitle(f"{profile.engine} · {Path(profile.model).name or profile.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
