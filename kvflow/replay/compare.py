"""Side-by-side comparison of several JSON replay reports as one markdown table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvflow.replay.report import LatencyStats, Report, load_report

__all__ = ["compare", "compare_reports"]


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.1f}"


def _lat(get: Callable[[Report], LatencyStats], field: str) -> Callable[[Report], str]:
    return lambda r: _ms(getattr(get(r), field))


_ROWS: list[tuple[str, Callable[[Report], str]]] = [
    ("trace", lambda r: r.trace),
    ("mode", lambda r: r.mode),
    ("policy", lambda r: r.policy),
    ("workers", lambda r: str(r.workers)),
    ("requests (completed / failed)", lambda r: f"{r.requests:,} ({r.completed:,} / {r.failed:,})"),
    ("router: shed / queued", lambda r: "–" if r.shed is None and r.queued is None
     else f"{r.shed or 0:,} / {r.queued or 0:,}"),
    ("duration (s)", lambda r: f"{r.duration_s:,.1f}"),
    ("prefix hit rate", lambda r: f"{r.prefix_hit_rate:.1%}"),
    ("hit rate device / host / disk", lambda r: "–" if r.tier_hit_rates is None else " / ".join(
        f"{r.tier_hit_rates.get(t, 0.0):.1%}" for t in ("device", "host", "disk"))),
    ("recomputed prefill tokens", lambda r: "–" if r.recomputed_prefill_tokens is None
     else f"{r.recomputed_prefill_tokens:,}"),
    ("TTFT p50 (ms)", _lat(lambda r: r.ttft_ms, "p50")),
    ("TTFT p90 (ms)", _lat(lambda r: r.ttft_ms, "p90")),
    ("TTFT p99 (ms)", _lat(lambda r: r.ttft_ms, "p99")),
    ("ITL p50 (ms)", _lat(lambda r: r.itl_ms, "p50")),
    ("ITL p99 (ms)", _lat(lambda r: r.itl_ms, "p99")),
    ("TPOT p50 (ms)", _lat(lambda r: r.tpot_ms, "p50")),
    ("e2e p50 (ms)", _lat(lambda r: r.e2e_ms, "p50")),
    ("e2e p99 (ms)", _lat(lambda r: r.e2e_ms, "p99")),
    ("queue p99 (ms)", _lat(lambda r: r.queue_ms, "p99")),
    ("output tokens/s", lambda r: f"{r.output_tokens_per_s:,.0f}"),
    ("requests/s", lambda r: f"{r.requests_per_s:.2f}"),
    ("goodput (req/s)", lambda r: f"{r.goodput.requests_per_s:.2f} ({r.goodput.fraction:.1%})"),
    ("SLA attainment (95% interval)", lambda r: "–" if r.sla_attainment is None else f"{r.sla_attainment:.2%}"
     + (f" ({r.sla_attainment_ci95[0]:.2%}–{r.sla_attainment_ci95[1]:.2%})" if r.sla_attainment_ci95 else "")),
    ("wall time (s)", lambda r: "–" if r.wall_time_s is None else f"{r.wall_time_s:.1f}"),
]


def compare(reports: Sequence[Report], labels: Sequence[str] | None = None) -> str:
    """Markdown table: one row per metric, one column per report.

    ``labels`` name the columns (default: ``policy`` of each report).

    Raises:
        ValueError: no reports, or ``labels`` of the wrong length.
    """
    if not reports:
        raise ValueError("nothing to compare")
    labels = list(labels) if labels is not None else [r.policy for r in reports]
    if len(labels) != len(reports):
        raise ValueError(f"{len(labels)} labels for {len(reports)} reports")
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(reports)]
    for name, get in _ROWS:
        lines.append(f"| {name} | " + " | ".join(get(r) for r in reports) + " |")
    return "\n".join(lines) + "\n"


def compare_reports(paths: Sequence[str | Path]) -> str:
    """Load JSON reports from ``paths`` and :func:`compare` them; columns are the file stems.

    Raises:
        FileNotFoundError: a path does not exist.
        pydantic.ValidationError: a file is not a replay report.
        ValueError: no paths.
    """
    return compare([load_report(p) for p in paths], [Path(p).stem for p in paths])
