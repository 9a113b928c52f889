"""Read planner inputs back from ClickHouse as plain dataclasses.

All windows are half-open ``[t0_ms, t1_ms)`` in epoch milliseconds on the
records' own clock (``ts_ms``), so the same queries serve wall-clock runs and
replays on a simulated clock. Undefined statistics (no rows) are ``None``.

Conventions, applied in SQL:

* load statistics (request count, ISL, OSL, cached tokens) count every request;
* TTFT statistics count successful requests (``ok``);
* ITL statistics count successful requests with ``osl > 1`` (a one-token
  answer has no inter-token gap);
* percentiles are exact with linear interpolation between order statistics
  (ClickHouse ``quantileExactInclusive``, the same definition as numpy's
  default ``np.percentile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clickhouse_connect.driver.client import Client

from kvflow.planner.core import TrafficObservation
from kvflow.planner.sink import REQUEST_TABLE, WORKER_TABLE

__all__ = [
    "IntervalAggregates", "interval_aggregates",
    "WorkerAggregates", "worker_aggregates",
    "RateSeries", "request_rate_series",
]

_WINDOW = "ts >= fromUnixTimestamp64Milli({t0:Int64}) AND ts < fromUnixTimestamp64Milli({t1:Int64})"
_ITL_OK = "ok AND osl > 1"


def _num(value) -> float | None:
    """ClickHouse returns nan for aggregates over no rows; map that to None."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class IntervalAggregates:
    """Request statistics over one window ``[t0_ms, t1_ms)``. Latencies in ms, lengths in tokens.

    ``ttft_over_target`` / ``itl_over_target``: successful requests whose TTFT /
    mean ITL (requests with more than one output token) exceeded the targets
    the query was given (None: no target given)."""

    t0_ms: int
    t1_ms: int
    num_requests: int
    num_failed: int
    mean_isl: float | None
    mean_osl: float | None
    mean_cached_tokens: float | None
    mean_ttft_ms: float | None
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_itl_ms: float | None
    p50_itl_ms: float | None
    p99_itl_ms: float | None
    ttft_over_target: int | None = None
    itl_over_target: int | None = None

    @property
    def duration_s(self) -> float:
        """Window length in seconds."""
        return (self.t1_ms - self.t0_ms) / 1000.0

    @property
    def request_rate_per_s(self) -> float:
        """Finished requests per second over the window."""
        return self.num_requests / self.duration_s if self.duration_s > 0 else 0.0

    def to_observation(self) -> TrafficObservation:
        """The planner core's view of this window (means, and the 99th percentiles of TTFT and ITL)."""
        return TrafficObservation(
            duration_s=self.duration_s,
            num_requests=self.num_requests,
            mean_isl=self.mean_isl,
            mean_osl=self.mean_osl,
            mean_ttft_ms=self.mean_ttft_ms,
            mean_itl_ms=self.mean_itl_ms,
            mean_cached_tokens=self.mean_cached_tokens,
            p99_ttft_ms=self.p99_ttft_ms,
            p99_itl_ms=self.p99_itl_ms,
        )


def interval_aggregates(client: Client, t0_ms: int, t1_ms: int, *, model: str | None = None,
                        ttft_target_ms: float | None = None, itl_target_ms: float | None = None) -> IntervalAggregates:
    """Aggregate ``request_metrics`` over ``[t0_ms, t1_ms)``, optionally for one ``model``;
    with targets, also count the requests over each (the fast path's tail test,
    :func:`kvflow.planner.reactive.tail_excess`).

    Raises:
        ValueError: ``t1_ms <= t0_ms``.
    """
    if t1_ms <= t0_ms:
        raise ValueError(f"empty window [{t0_ms}, {t1_ms})")
    where = _WINDOW + (" AND model = {model:String}" if model is not None else "")
    sql = f"""
        SELECT count(), countIf(NOT ok), avg(isl), avg(osl), avg(cached_tokens),
               avgIf(ttft_ms, ok), quantilesExactInclusiveIf(0.5, 0.99)(ttft_ms, ok),
               avgIf(itl_ms, {_ITL_OK}), quantilesExactInclusiveIf(0.5, 0.99)(itl_ms, {_ITL_OK}),
               countIf(ok AND ttft_ms > {{ttft_target:Float64}}), countIf({_ITL_OK} AND itl_ms > {{itl_target:Float64}})
        FROM {REQUEST_TABLE} WHERE {where}"""
    params = {"t0": t0_ms, "t1": t1_ms, "ttft_target": ttft_target_ms or 0.0, "itl_target": itl_target_ms or 0.0}
    if model is not None:
        params["model"] = model
    (n, n_failed, isl, osl, cached, ttft, ttft_q, itl, itl_q, ttft_over,
     itl_over) = client.query(sql, parameters=params).result_rows[0]
    return IntervalAggregates(
        t0_ms=t0_ms, t1_ms=t1_ms, num_requests=int(n), num_failed=int(n_failed),
        mean_isl=_num(isl), mean_osl=_num(osl), mean_cached_tokens=_num(cached),
        mean_ttft_ms=_num(ttft), p50_ttft_ms=_num(ttft_q[0]), p99_ttft_ms=_num(ttft_q[1]),
        mean_itl_ms=_num(itl), p50_itl_ms=_num(itl_q[0]), p99_itl_ms=_num(itl_q[1]),
        ttft_over_target=None if ttft_target_ms is None else int(ttft_over),
        itl_over_target=None if itl_target_ms is None else int(itl_over),
    )


@dataclass(frozen=True)
class WorkerAggregates:
    """One worker over the last ``window_s``: its finished requests and its load snapshots.

    Request fields are ``None``/0 when the worker finished no request in the
    window; snapshot fields are ``None`` when it published no snapshot.
    ``last_*`` come from the newest snapshot; ``mean_kv_usage`` is the mean of
    used/total KV blocks over the snapshots; throughputs are snapshot means in
    tokens/s.
    """

    worker_id: str
    num_requests: int
    mean_isl: float | None
    mean_osl: float | None
    mean_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_itl_ms: float | None
    p99_itl_ms: float | None
    num_snapshots: int
    role: str | None
    last_ts_ms: int | None
    last_active_requests: int | None
    last_waiting_requests: int | None
    last_kv_used_blocks: int | None
    last_kv_total_blocks: int | None
    mean_kv_usage: float | None
    mean_prefill_tokens_per_s: float | None
    mean_decode_tokens_per_s: float | None


def worker_aggregates(client: Client, now_ms: int, window_s: float = 60.0) -> list[WorkerAggregates]:
    """Per-worker statistics over ``[now_ms - window_s*1000, now_ms)``, sorted by ``worker_id``.

    Workers appear if they have either a finished request or a snapshot in the window.
    """
    params = {"t0": now_ms - int(window_s * 1000), "t1": now_ms}
    req_sql = f"""
        SELECT worker_id, count(), avg(isl), avg(osl),
               avgIf(ttft_ms, ok), quantileExactInclusiveIf(0.99)(ttft_ms, ok),
               avgIf(itl_ms, {_ITL_OK}), quantileExactInclusiveIf(0.99)(itl_ms, {_ITL_OK})
        FROM {REQUEST_TABLE} WHERE {_WINDOW} GROUP BY worker_id"""
    snap_sql = f"""
        SELECT worker_id, count(), argMax(role, ts), toUnixTimestamp64Milli(max(ts)),
               argMax(active_requests, ts), argMax(waiting_requests, ts),
               argMax(kv_used_blocks, ts), argMax(kv_total_blocks, ts),
               avg(kv_used_blocks / nullIf(kv_total_blocks, 0)),
               avg(prefill_tokens_per_s), avg(decode_tokens_per_s)
        FROM {WORKER_TABLE} WHERE {_WINDOW} GROUP BY worker_id"""
    reqs = {row[0]: row for row in client.query(req_sql, parameters=params).result_rows}
    snaps = {row[0]: row for row in client.query(snap_sql, parameters=params).result_rows}
    out = []
    for wid in sorted(set(reqs) | set(snaps)):
        r = reqs.get(wid)
        s = snaps.get(wid)
        out.append(WorkerAggregates(
            worker_id=wid,
            num_requests=int(r[1]) if r else 0,
            mean_isl=_num(r[2]) if r else None,
            mean_osl=_num(r[3]) if r else None,
            mean_ttft_ms=_num(r[4]) if r else None,
            p99_ttft_ms=_num(r[5]) if r else None,
            mean_itl_ms=_num(r[6]) if r else None,
            p99_itl_ms=_num(r[7]) if r else None,
            num_snapshots=int(s[1]) if s else 0,
            role=s[2] if s else None,
            last_ts_ms=int(s[3]) if s else None,
            last_active_requests=int(s[4]) if s else None,
            last_waiting_requests=int(s[5]) if s else None,
            last_kv_used_blocks=int(s[6]) if s else None,
            last_kv_total_blocks=int(s[7]) if s else None,
            mean_kv_usage=_num(s[8]) if s else None,
            mean_prefill_tokens_per_s=_num(s[9]) if s else None,
            mean_decode_tokens_per_s=_num(s[10]) if s else None,
        ))
    return out


@dataclass(frozen=True)
class RateSeries:
    """Finished requests binned by time. Bin ``i`` covers ``[bin_start_ms[i], bin_start_ms[i] + bin_ms)``,
    clipped to the query's ``t1_ms`` for the last bin; empty bins hold 0 requests and ``None`` means."""

    t0_ms: int
    t1_ms: int
    bin_ms: int
    bin_start_ms: tuple[int, ...]
    num_requests: tuple[int, ...]
    mean_isl: tuple[float | None, ...]
    mean_osl: tuple[float | None, ...]

    @property
    def rate_per_s(self) -> tuple[float, ...]:
        """Requests per second in each bin (the last bin divides by its clipped length)."""
        out = []
        for start, n in zip(self.bin_start_ms, self.num_requests):
            length_ms = min(self.bin_ms, self.t1_ms - start)
            out.append(n * 1000.0 / length_ms)
        return tuple(out)


def request_rate_series(client: Client, t0_ms: int, t1_ms: int, bin_s: float,
                        *, model: str | None = None) -> RateSeries:
    """Bin finished requests of ``[t0_ms, t1_ms)`` into ``bin_s``-second bins starting at ``t0_ms``.

    Raises:
        ValueError: empty window or ``bin_s`` under 1 ms.
    """
    bin_ms = int(round(bin_s * 1000))
    if t1_ms <= t0_ms or bin_ms < 1:
        raise ValueError(f"need t1_ms > t0_ms and bin_s >= 0.001 (got [{t0_ms}, {t1_ms}), {bin_s})")
    where = _WINDOW + (" AND model = {model:String}" if model is not None else "")
    sql = f"""
        SELECT intDiv(toUnixTimestamp64Milli(ts) - {{t0:Int64}}, {{bin:Int64}}) AS b, count(), avg(isl), avg(osl)
        FROM {REQUEST_TABLE} WHERE {where} GROUP BY b ORDER BY b"""
    params = {"t0": t0_ms, "t1": t1_ms, "bin": bin_ms} | ({"model": model} if model is not None else {})
    rows = client.query(sql, parameters=params).result_rows
    num_bins = -(-(t1_ms - t0_ms) // bin_ms)
    counts = [0] * num_bins
    isl: list[float | None] = [None] * num_bins
    osl: list[float | None] = [None] * num_bins
    for b, n, mi, mo in rows:
        counts[b], isl[b], osl[b] = int(n), _num(mi), _num(mo)
    return RateSeries(t0_ms=t0_ms, t1_ms=t1_ms, bin_ms=bin_ms,
                      bin_start_ms=tuple(t0_ms + i * bin_ms for i in range(num_bins)),
                      num_requests=tuple(counts), mean_isl=tuple(isl), mean_osl=tuple(osl))
