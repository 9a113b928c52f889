"""Per-pool figures of an offline replay with worker pools (:mod:`kvflow.router.pools`).

Each request counts in the pool of the worker that decoded it (its
``RequestRecord.worker_id``; ``SimResult.worker_pools`` maps workers to
pools). Per pool: requests completed and failed, TTFT p50/p99 (ms), and the
request's mean ITL, (last token − first token) / (output tokens − 1), at p50
and p99 (ms; requests with at least two output tokens).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from kvflow.replay.report import RequestRecord

__all__ = ["pool_report"]


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def pool_report(records: list[RequestRecord], worker_pools: dict[str, str]) -> dict[str, dict]:
    """Figures per pool name (module docstring); requests never placed on a worker count under ``"-"``."""
    by_pool: dict[str, list[RequestRecord]] = defaultdict(list)
    for rec in records:
        by_pool[worker_pools.get(rec.worker_id, "-") if rec.worker_id else "-"].append(rec)
    out = {}
    for pool in sorted(by_pool):
        recs = by_pool[pool]
        ok = [r for r in recs if r.ok]
        ttft = [r.first_token_ms - r.arrival_ms for r in ok]
        itl = [(r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        out[pool] = {"completed": len(ok), "failed": len(recs) - len(ok),
                     "isl_mean": round(float(np.mean([r.isl for r in recs])), 1),
                     "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
                     "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99)}
    return out
