"""The replay report: per-request records → one JSON-able :class:`Report`.

Offline simulation and online replay both fill :class:`RequestRecord`s (times
in ms on their own clock, 0 = trace start) and pooled inter-token gaps, and
call :func:`build_report`, so both produce the same report shape.

Definitions (all latencies in ms):

* TTFT = first output token time − arrival time.
* ITL = every gap between successive output tokens of a request, pooled over
  all requests (tokens delivered together count as 0 ms gaps).
* TPOT (per request) = (e2e − TTFT) / (output tokens − 1), requests with at
  least two tokens.
* e2e = last token time − arrival time.
* queue = first scheduled time − arrival time (offline only: when an engine
  step first included the request).
* prefix hit rate = cached prompt tokens / prompt tokens, over completed requests.
* goodput = completed requests per second with TTFT <= ``sla_ttft_ms`` and
  TPOT <= ``sla_itl_ms`` (one-token requests are judged on TTFT alone), the
  per-request SLA test of vLLM's ``benchmark_serving --goodput``
  (:func:`meets_sla`).
* SLA attainment = requests meeting that test / all requests (failed ones
  count as misses); equal to ``goodput.fraction``. Its 95% interval
  (``sla_attainment_ci95``) is a block bootstrap over minutes of arrival
  time (:func:`attainment_interval`): the sampling uncertainty of the figure
  when the trace's minutes are taken as draws from the same traffic. Two
  runs whose intervals overlap widely are not told apart by one replay.
* replica-hours = the integral over the run of live workers (serving or
  draining), from trace start to the last completion, in hours.
* disaggregated runs (:class:`DisaggSummary`): a remotely prefilled request
  counts on its prefill worker for prompt and cached tokens and on its
  decode worker for output tokens (both count the request); TTFT includes
  the KV transfer; the prefix hit rate is the prefill worker's hit.

Percentiles are numpy's default (linear interpolation between order statistics).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

__all__ = [
    "RequestRecord",
    "TimelineSample",
    "LatencyStats",
    "Goodput",
    "WorkerSummary",
    "TimelinePoint",
    "PlannerTickPoint",
    "ReplicaStep",
    "StaticRun",
    "PlannerSummary",
    "PoolSummary",
    "DisaggSummary",
    "Report",
    "latency_stats",
    "meets_sla",
    "attainment_interval",
    "sla_attainment",
    "build_report",
    "disagg_summary",
    "load_report",
    "write_json",
    "render_markdown",
]


@dataclass(slots=True)
class RequestRecord:
    """One request's life in a replay. Times in ms from trace start; None = never happened.

    ``output_tokens`` counts tokens received; ``cached_tokens`` is the prompt
    prefix served from the prefix cache; ``error`` is set for failed requests.
    A remotely prefilled request (disaggregated replay) names its
    ``prefill_worker_id`` (``worker_id`` is then the decode worker) and the
    modelled KV transfer: ``kv_transfer_ms`` and ``kv_transfer_tokens``
    (prompt tokens moved, i.e. not in the decode worker's prefix cache).
    """

    request_id: str
    arrival_ms: float
    isl: int
    osl: int
    worker_id: str = ""
    scheduled_ms: float | None = None
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    finish_ms: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    prefill_worker_id: str = ""
    kv_transfer_ms: float | None = None
    kv_transfer_tokens: int = 0

    @property
    def ok(self) -> bool:
        """Completed without error."""
        return self.error is None and self.finish_ms is not None


@dataclass(slots=True)
class TimelineSample:
    """Per-worker load at ``t_ms`` and prompt/cached tokens of requests whose
    first token came since the previous sample."""

    t_ms: float
    load: list[int]
    kv_usage: list[float]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    arrivals: int = 0


class LatencyStats(BaseModel):
    """Summary of a latency sample in ms; ``count`` 0 gives all None."""

    model_config = ConfigDict(frozen=True)
    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None


class Goodput(BaseModel):
    """Requests per second meeting the SLA, and their fraction of all requests."""

    model_config = ConfigDict(frozen=True)
    requests_per_s: float
    fraction: float
    sla_ttft_ms: float
    sla_itl_ms: float


class WorkerSummary(BaseModel):
    """One worker's share. ``busy_fraction`` (engine stepping time / duration)
    is None online, where it is not observed. In a disaggregated run a
    remotely prefilled request adds its prompt and cached tokens to its
    prefill worker and its output tokens to its decode worker."""

    model_config = ConfigDict(frozen=True)
    worker_id: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    prefix_hit_rate: float
    output_tokens: int
    busy_fraction: float | None = None


class TimelinePoint(BaseModel):
    """Load over time: per-worker in-flight requests and KV usage at ``t_s``,
    the prefix hit rate of requests first served in the preceding interval
    (None if none) and arrivals in it."""

    model_config = ConfigDict(frozen=True)
    t_s: float
    load: list[int]
    kv_usage: list[float]
    hit_rate: float | None
    arrivals: int


class PlannerTickPoint(BaseModel):
    """One SLA planner tick in an offline replay, at ``t_s`` (simulated seconds).

    Observed values describe the interval just ended (requests that finished
    in it, as the live planner queries them): ``observed_rate_per_s``
    (requests/s), ``mean_isl``/``mean_osl`` (tokens), ``mean_ttft_ms``,
    ``mean_itl_ms`` (mean of per-request mean ITL), ``kv_hit_rate`` (cached /
    prompt tokens); None without finished requests. ``predicted_rate_per_s``
    is the core's forecast for the interval starting now.
    ``serving_replicas`` ran before the tick; ``needed_replicas`` is what the
    load required and ``target_replicas`` what the planner set (after hold and
    budget). Corrections are the core's observed/expected latency factors.
    """

    model_config = ConfigDict(frozen=True)
    t_s: float
    num_requests: int
    observed_rate_per_s: float
    predicted_rate_per_s: float
    mean_isl: float | None
    mean_osl: float | None
    mean_ttft_ms: float | None
    mean_itl_ms: float | None
    kv_hit_rate: float | None
    serving_replicas: int
    needed_replicas: int
    target_replicas: int
    prefill_correction: float
    decode_correction: float


class ReplicaStep(BaseModel):
    """From ``t_s`` (simulated seconds) on, ``serving`` workers take new
    requests and ``live`` workers exist (serving plus draining)."""

    model_config = ConfigDict(frozen=True)
    t_s: float
    serving: int
    live: int


class StaticRun(BaseModel):
    """The same trace on a fixed pool of ``replicas`` workers."""

    model_config = ConfigDict(frozen=True)
    replicas: int
    sla_attainment: float
    replica_hours: float


class PlannerSummary(BaseModel):
    """How the SLA planner ran in an offline replay, and its static baselines.

    ``settings``: the planner settings used. ``sla_target``: the attainment
    the static-peak search must reach. ``static_peak_replicas``: the smallest
    static pool whose attainment is at least ``sla_target`` (searched between
    1 and ``max_replicas``; ``static_peak_meets_target`` false when even
    ``max_replicas`` misses it, and then it is ``max_replicas``).
    ``static_mean_replicas``: the planner run's time-weighted mean of live
    workers, rounded up. ``static_runs``: every static pool simulated, by size.
    ``replica_hours_vs_static_peak``: planner replica-hours / static-peak
    replica-hours.
    """

    model_config = ConfigDict(frozen=True)
    settings: dict[str, Any]
    sla_target: float
    ticks: list[PlannerTickPoint]
    replicas: list[ReplicaStep]
    max_replicas: int
    planner_max_replicas: int
    planner_mean_replicas: float
    static_peak_replicas: int
    static_peak_meets_target: bool
    static_mean_replicas: int
    static_runs: list[StaticRun]
    replica_hours_vs_static_peak: float


class PoolSummary(BaseModel):
    """One worker pool of a disaggregated replay.

    ``role``: ``prefill``, ``decode`` or ``aggregated``. ``requests``:
    completed requests whose prefill (prefill pool) or decode (other pools)
    ran there. ``busy_fraction``: mean over the pool's workers of engine
    stepping time / run duration. ``prefill_tokens``/``decode_tokens``:
    tokens the pool's engines computed (prefix-cache hits excluded).
    """

    model_config = ConfigDict(frozen=True)
    role: str
    workers: int
    requests: int
    busy_fraction: float
    prefill_tokens: int
    decode_tokens: int


class DisaggSummary(BaseModel):
    """How the conditional-disaggregation rule placed a replay's requests.

    ``remote_prefills``/``local_prefills``: requests whose prefill ran on a
    prefill worker / on their decode (or aggregated) worker; ``local_reasons``
    counts the rule's clause for the local ones (``short_prompt``,
    ``prefill_queue_full``, ``no_prefill_workers``). ``kv_transfer_ms``: the
    modelled transfer time of completed remote requests; ``kv_transfer_tokens``:
    prompt tokens they moved. Thresholds are the
    :class:`~kvflow.router.disagg.DisaggConfig` used.
    """

    model_config = ConfigDict(frozen=True)
    prefill_threshold_tokens: int
    max_prefill_queue_per_worker: int
    remote_prefills: int
    local_prefills: int
    local_reasons: dict[str, int]
    kv_transfer_ms: LatencyStats
    kv_transfer_tokens: int
    pools: list[PoolSummary]


class Report(BaseModel):
    """A replay's results. Durations in seconds, latencies in ms.

    ``duration_s`` runs from trace start (first arrival at 0) to the last
    completion. ``block_size``/``total_kv_blocks`` (all workers) are None
    online when unknown. ``wall_time_s`` is how long the replay itself ran.
    ``sla_attainment`` is the fraction of all requests meeting both goodput
    thresholds, ``sla_attainment_ci95`` its 95% block-bootstrap interval
    (:func:`attainment_interval`; None with under two minutes of arrivals).
    Offline, ``replica_hours`` is the integral of live workers over the run
    (hours). With the SLA planner (``planner`` set), the
    ``static_*`` fields give replica-hours and attainment of the same trace on
    the static-peak and static-mean pools (see :class:`PlannerSummary`).
    ``disagg`` describes a disaggregated offline replay (None otherwise).
    Offline, ``shed`` counts requests the router shed (failed: every worker
    busy with the queue full or off, or a deadline passed while held) and
    ``queued`` those it held in its bounded queue before routing or
    shedding them (the ``shed_*`` settings, :mod:`kvflow.router.shedding`);
    None online, where the router's decisions are not observed.
    Offline, ``recomputed_prefill_tokens`` counts prompt tokens the engines
    computed although some worker had computed their block earlier in the
    run (it was evicted, or is cached on another worker);
    ``tier_hit_rates`` gives the fraction of prompt tokens served from each
    KV tier (``device``, ``host``, ``disk``; they sum to the prefix hit rate
    of requests that got a first token); ``kv_tiers`` sums the workers'
    offload/onboard counters (:class:`~kvflow.workers.kv.tiers.TierStats`;
    None without host or disk tier). All three are None online.
    ``pools``: offline with worker pools, the figures of each pool
    (:func:`kvflow.replay.pool_report.pool_report`); with the planner also
    under ``planner`` its per-pool figures
    (:meth:`kvflow.replay.pool_planner.PoolFigures.as_dict`: SLA attainment,
    replica-hours and workers per role); None otherwise.
    """

    model_config = ConfigDict(frozen=True)
    mode: Literal["offline", "online"]
    trace: str
    trace_format: str
    policy: str
    workers: int
    seed: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    ttft_ms: LatencyStats
    itl_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    queue_ms: LatencyStats
    prefix_hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    goodput: Goodput
    block_size: int | None = None
    total_kv_blocks: int | None = None
    per_worker: list[WorkerSummary]
    timeline: list[TimelinePoint] = []
    options: dict[str, Any] = {}
    wall_time_s: float | None = None
    sla_attainment: float | None = None
    sla_attainment_ci95: tuple[float, float] | None = None
    replica_hours: float | None = None
    static_peak_replica_hours: float | None = None
    static_mean_replica_hours: float | None = None
    static_peak_sla_attainment: float | None = None
    static_mean_sla_attainment: float | None = None
    planner: PlannerSummary | None = None
    disagg: DisaggSummary | None = None
    shed: int | None = None
    queued: int | None = None
    recomputed_prefill_tokens: int | None = None
    tier_hit_rates: dict[str, float] | None = None
    kv_tiers: dict[str, float] | None = None
    pools: dict[str, dict] | None = None
    quantiles_ms: dict[str, list[float]] = {}
    """``ttft``, ``itl`` and ``e2e`` latency at each percentile 0, 1, ..., 100 (101
    values, ms; absent without samples): the CDFs ``kvflow replay compare --plots`` draws."""


def latency_stats(values: Sequence[float] | np.ndarray) -> LatencyStats:
    """p50/p90/p99/mean of ``values`` (numpy linear-interpolation percentiles)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return LatencyStats(count=0, p50=None, p90=None, p99=None, mean=None)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return LatencyStats(count=int(arr.size), p50=float(p50), p90=float(p90), p99=float(p99), mean=float(arr.mean()))


def _tpot(r: RequestRecord) -> float | None:
    if r.output_tokens < 2 or r.first_token_ms is None or r.last_token_ms is None:
        return None
    return (r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1)


def meets_sla(r: RequestRecord, sla_ttft_ms: float, sla_itl_ms: float) -> bool:
    """Whether ``r`` completed with TTFT <= ``sla_ttft_ms`` and TPOT (its mean
    ITL) <= ``sla_itl_ms``; a one-token request is judged on TTFT alone."""
    if not r.ok or r.first_token_ms is None or r.first_token_ms - r.arrival_ms > sla_ttft_ms:
        return False
    tpot = _tpot(r)
    return tpot is None or tpot <= sla_itl_ms


def sla_attainment(records: Sequence[RequestRecord], sla_ttft_ms: float, sla_itl_ms: float) -> float:
    """Fraction of ``records`` meeting :func:`meets_sla` (failures count as
    misses); 0 for no records."""
    if not records:
        return 0.0
    return sum(meets_sla(r, sla_ttft_ms, sla_itl_ms) for r in records) / len(records)


def attainment_interval(records: Sequence[RequestRecord], sla_ttft_ms: float, sla_itl_ms: float, *,
                        window_s: float = 60.0, level: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float] | None:
    """Block-bootstrap interval of SLA attainment (:func:`sla_attainment`).

    Requests are grouped into non-overlapping windows of ``window_s`` seconds
    of arrival time (neighbouring requests share queues, so they are not
    independent); ``resamples`` times, as many windows as there are are drawn
    with replacement and the attainment of the drawn requests computed. The
    interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    those figures: the moving/non-overlapping block bootstrap (Künsch, Annals
    of Statistics 17(3), 1989; Carlstein, same volume) with the percentile
    interval (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993,
    ch. 13). Deterministic for a given ``seed``.

    Returns:
        ``(low, high)`` fractions in [0, 1], or None with fewer than two
        non-empty windows.

    Raises:
        ValueError: ``window_s`` <= 0, ``level`` outside (0, 1) or ``resamples`` < 1.
    """
    return _block_bootstrap([r.arrival_ms for r in records], [meets_sla(r, sla_ttft_ms, sla_itl_ms) for r in records],
                            window_s=window_s, level=level, resamples=resamples, seed=seed)


def _block_bootstrap(arrival_ms: Sequence[float], met: Sequence[bool], *, window_s: float = 60.0,
                     level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """:func:`attainment_interval` from each request's arrival (ms) and SLA verdict."""
    if window_s <= 0 or not 0 < level < 1 or resamples < 1:
        raise ValueError("need window_s > 0, 0 < level < 1 and resamples >= 1")
    if not arrival_ms:
        return None
    _, window = np.unique(np.floor_divide(np.asarray(arrival_ms, dtype=np.float64), window_s * 1000.0),
                          return_inverse=True)
    met = np.asarray(met, dtype=np.float64)
    n = np.bincount(window).astype(np.float64)
    good = np.bincount(window, weights=met)
    if n.size < 2:
        return None
    rng = np.random.default_rng(seed)
    figures = np.empty(resamples)
    chunk = max(1, 1_000_000 // n.size)  # bound the index matrix to ~8 MB
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        drawn = rng.integers(0, n.size, size=(stop - start, n.size))
        figures[start:stop] = good[drawn].sum(axis=1) / n[drawn].sum(axis=1)
    low, high = np.quantile(figures, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high)


@dataclass
class _WorkerAcc:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def build_report(
    records: Sequence[RequestRecord],
    itl_gaps_ms: Sequence[float] | np.ndarray,
    *,
    mode: Literal["offline", "online"],
    trace: str,
    trace_format: str,
    policy: str,
    workers: Sequence[str],
    seed: int,
    sla_ttft_ms: float = 500.0,
    sla_itl_ms: float = 50.0,
    block_size: int | None = None,
    total_kv_blocks: int | None = None,
    busy_ms: dict[str, float] | None = None,
    timeline: Sequence[TimelineSample] = (),
    options: dict[str, Any] | None = None,
    wall_time_s: float | None = None,
    shed: int | None = None,
    queued: int | None = None,
) -> Report:
    """Summarise request records into a :class:`Report` (definitions in the module docstring).

    ``workers`` lists every worker id (so idle workers appear in
    ``per_worker``); ``busy_ms`` maps worker id → time spent stepping;
    ``shed``/``queued`` are the router's counts (offline; None when unknown).
    """
    done = [r for r in records if r.ok]
    failed = len(records) - len(done)
    end_ms = max((r.finish_ms for r in done), default=0.0)
    duration_s = end_ms / 1000.0
    ttft = [r.first_token_ms - r.arrival_ms for r in done if r.first_token_ms is not None]
    e2e = [r.finish_ms - r.arrival_ms for r in done]
    tpots = [t for t in map(_tpot, done) if t is not None]
    queue = [r.scheduled_ms - r.arrival_ms for r in done if r.scheduled_ms is not None]
    prompt = sum(r.isl for r in done)
    cached = sum(r.cached_tokens for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    met = [meets_sla(r, sla_ttft_ms, sla_itl_ms) for r in records]  # failed requests never meet it
    good = sum(met)
    acc = {w: _WorkerAcc() for w in workers}
    for r in done:
        a = acc.setdefault(r.worker_id, _WorkerAcc())
        a.requests += 1
        a.output_tokens += r.output_tokens
        if r.prefill_worker_id:  # the prompt was computed (and cache-hit) on the prefill worker
            a = acc.setdefault(r.prefill_worker_id, _WorkerAcc())
            a.requests += 1
        a.prompt_tokens += r.isl
        a.cached_tokens += r.cached_tokens
    per_worker = [
        WorkerSummary(worker_id=w, requests=a.requests, prompt_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens,
                      prefix_hit_rate=a.cached_tokens / a.prompt_tokens if a.prompt_tokens else 0.0,
                      output_tokens=a.output_tokens,
                      busy_fraction=(busy_ms.get(w, 0.0) / end_ms if end_ms else 0.0) if busy_ms is not None else None)
        for w, a in acc.items()
    ]
    points = [
        TimelinePoint(t_s=s.t_ms / 1000.0, load=list(s.load), kv_usage=[round(u, 4) for u in s.kv_usage],
                      hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else None, arrivals=s.arrivals)
        for s in timeline
    ]

    def rate(n: int) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    return Report(
        mode=mode, trace=trace, trace_format=trace_format, policy=policy, workers=len(workers), seed=seed,
        requests=len(records), completed=len(done), failed=failed, duration_s=duration_s,
        ttft_ms=latency_stats(ttft), itl_ms=latency_stats(itl_gaps_ms), tpot_ms=latency_stats(tpots),
        e2e_ms=latency_stats(e2e), queue_ms=latency_stats(queue),
        prefix_hit_rate=cached / prompt if prompt else 0.0, prompt_tokens=prompt, cached_tokens=cached,
        output_tokens=out_tokens, output_tokens_per_s=rate(out_tokens), requests_per_s=rate(len(done)),
        goodput=Goodput(requests_per_s=rate(good), fraction=good / len(records) if records else 0.0,
                        sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms),
        block_size=block_size, total_kv_blocks=total_kv_blocks, per_worker=per_worker, timeline=points,
        options=options or {}, wall_time_s=wall_time_s,
        sla_attainment=good / len(records) if records else 0.0,
        sla_attainment_ci95=_block_bootstrap([r.arrival_ms for r in records], met),
        shed=shed, queued=queued,
        quantiles_ms={name: [round(float(v), 3) for v in np.quantile(np.asarray(vals, dtype=np.float64),
                                                                    np.linspace(0, 1, 101))]
                      for name, vals in (("ttft", ttft), ("itl", itl_gaps_ms), ("e2e", e2e)) if len(vals)},
    )


def disagg_summary(
    records: Sequence[RequestRecord],
    *,
    worker_roles: Mapping[str, str],
    busy_ms: Mapping[str, float],
    duration_ms: float,
    prefill_tokens: Mapping[str, int],
    decode_tokens: Mapping[str, int],
    prefill_plans: Mapping[str, int],
    prefill_threshold_tokens: int,
    max_prefill_queue_per_worker: int,
) -> DisaggSummary:
    """Summarise a disaggregated replay (see :class:`DisaggSummary`).

    ``worker_roles`` maps every worker id to its role; ``busy_ms``,
    ``prefill_tokens`` and ``decode_tokens`` are per worker (ms, tokens);
    ``duration_ms`` is the run's duration (the report's ``duration_s`` × 1000);
    ``prefill_plans`` counts the rule's outcomes by reason (``remote`` and the
    local clauses). Pools are listed prefill, decode, aggregated, those with
    workers only.
    """
    done = [r for r in records if r.ok]
    served: dict[str, int] = {}
    for r in done:
        served[r.worker_id] = served.get(r.worker_id, 0) + 1
        if r.prefill_worker_id:
            served[r.prefill_worker_id] = served.get(r.prefill_worker_id, 0) + 1
    pools = []
    for role in ("prefill", "decode", "aggregated"):
        ids = [w for w, r in worker_roles.items() if r == role]
        if not ids:
            continue
        busy = [busy_ms.get(w, 0.0) / duration_ms if duration_ms else 0.0 for w in ids]
        pools.append(PoolSummary(role=role, workers=len(ids), requests=sum(served.get(w, 0) for w in ids),
                                 busy_fraction=sum(busy) / len(busy),
                                 prefill_tokens=sum(prefill_tokens.get(w, 0) for w in ids),
                                 decode_tokens=sum(decode_tokens.get(w, 0) for w in ids)))
    remote = [r for r in done if r.prefill_worker_id and r.kv_transfer_ms is not None]
    return DisaggSummary(
        prefill_threshold_tokens=prefill_threshold_tokens, max_prefill_queue_per_worker=max_prefill_queue_per_worker,
        remote_prefills=prefill_plans.get("remote", 0),
        local_prefills=sum(n for k, n in prefill_plans.items() if k != "remote"),
        local_reasons={k: n for k, n in sorted(prefill_plans.items()) if k != "remote"},
        kv_transfer_ms=latency_stats([r.kv_transfer_ms for r in remote]),
        kv_transfer_tokens=sum(r.kv_transfer_tokens for r in remote), pools=pools,
    )


def load_report(path: str | Path) -> Report:
    """Read a JSON report written by :func:`write_json`.

    Raises:
        pydantic.ValidationError: the file is not a report.
        FileNotFoundError: no such file.
    """
    return Report.model_validate_json(Path(path).read_text(encoding="utf-8"))


def write_json(report: Report, path: str | Path) -> None:
    """Write ``report`` as indented JSON (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.model_dump(mode="json"), indent=2) + "\n", encoding="utf-8")


def _f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def _planner_markdown(r: Report, pl: PlannerSummary) -> list[str]:
    peak_note = "" if pl.static_peak_meets_target else f" (misses the {pl.sla_target:.1%} target even at the cap)"
    rows = [("SLA planner", f"max {pl.planner_max_replicas}, mean {pl.planner_mean_replicas:.2f}",
             r.replica_hours, r.sla_attainment),
            (f"static peak{peak_note}", str(pl.static_peak_replicas), r.static_peak_replica_hours,
             r.static_peak_sla_attainment),
            ("static mean", str(pl.static_mean_replicas), r.static_mean_replica_hours, r.static_mean_sla_attainment)]
    intro = (f"SLA planner (predictor `{pl.settings.get('predictor')}`, every "
             f"{pl.settings.get('adjustment_interval_s')} s); static peak = smallest static pool with SLA "
             f"attainment >= {pl.sla_target:.1%}; the planner uses {pl.replica_hours_vs_static_peak:.1%} of its "
             "replica-hours.")
    lines = ["", intro, "", "| provisioning | workers | replica-hours | SLA attainment |", "|---|---:|---:|---:|"]
    for name, n, hours, sla in rows:
        lines.append(f"| {name} | {n} | {_f(hours, 3)} | {'–' if sla is None else f'{sla:.2%}'} |")
    return lines


def _disagg_markdown(d: DisaggSummary) -> list[str]:
    reasons = ", ".join(f"{k} {n:,}" for k, n in d.local_reasons.items()) or "none"
    t = d.kv_transfer_ms
    intro = (f"Disaggregation (remote prefill when uncached prompt > {d.prefill_threshold_tokens:,} tokens and "
             f"prefill queue < {d.max_prefill_queue_per_worker} per prefill worker): "
             f"{d.remote_prefills:,} remote, {d.local_prefills:,} local ({reasons}); KV transfer "
             f"p50/p99 {_f(t.p50)}/{_f(t.p99)} ms, {d.kv_transfer_tokens:,} prompt tokens moved.")
    lines = ["", intro, "", "| pool | workers | requests | busy | prefill tokens | decode tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in d.pools:
        lines.append(f"| {p.role} | {p.workers} | {p.requests:,} | {p.busy_fraction:.1%} | {p.prefill_tokens:,} | "
                     f"{p.decode_tokens:,} |")
    return lines


def render_markdown(report: Report) -> str:
    """A human-readable markdown summary of ``report`` (latency table, totals, workers)."""
    r = report
    lines = [
        f"# Replay of `{r.trace}` ({r.mode})",
        "",
        f"{r.workers} workers, policy `{r.policy}`, seed {r.seed}"
        + (f", block size {r.block_size}, {r.total_kv_blocks:,} KV blocks in all" if r.block_size else ""),
        "",
        f"- requests: {r.requests:,} ({r.completed:,} completed, {r.failed:,} failed) over {r.duration_s:,.1f} s",
        f"- throughput: {r.requests_per_s:.2f} req/s, {r.output_tokens_per_s:,.0f} output tokens/s",
        f"- prefix hit rate: {r.prefix_hit_rate:.1%} of {r.prompt_tokens:,} prompt tokens",
        f"- goodput: {r.goodput.requests_per_s:.2f} req/s ({r.goodput.fraction:.1%} of requests meet "
        f"TTFT ≤ {r.goodput.sla_ttft_ms:g} ms and ITL ≤ {r.goodput.sla_itl_ms:g} ms"
        + (f"; 95% interval {r.sla_attainment_ci95[0]:.2%}–{r.sla_attainment_ci95[1]:.2%}"
           if r.sla_attainment_ci95 else "") + ")",
    ]
    if r.shed is not None or r.queued is not None:
        lines.append(f"- router: {r.shed or 0:,} shed, {r.queued or 0:,} queued")
    if r.tier_hit_rates is not None:
        t = r.tier_hit_rates
        lines.append(f"- KV tiers: hit rate device {t.get('device', 0):.1%}, host {t.get('host', 0):.1%}, "
                     f"disk {t.get('disk', 0):.1%}; {r.recomputed_prefill_tokens or 0:,} prefill tokens recomputed")
    if r.replica_hours is not None:
        lines.append(f"- replica-hours: {r.replica_hours:.3f}")
    if r.wall_time_s is not None:
        lines.append(f"- wall time: {r.wall_time_s:.1f} s")
    if r.planner is not None:
        lines += _planner_markdown(r, r.planner)
    if r.disagg is not None:
        lines += _disagg_markdown(r.disagg)
    if r.pools:
        lines += ["", "| pool | completed | failed | mean ISL | TTFT p50 / p99 (ms) | mean ITL p50 / p99 (ms) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, p in r.pools.items():
            if "completed" not in p:  # a planned pool that served nothing
                continue
            lines.append(f"| {name or '(default)'} | {p['completed']:,} | {p['failed']:,} | {p['isl_mean']:,.0f} | "
                         f"{_f(p['ttft_p50_ms'])} / {_f(p['ttft_p99_ms'])} | {_f(p['itl_p50_ms'])} / "
                         f"{_f(p['itl_p99_ms'])} |")
        planned = {name: p["planner"] for name, p in r.pools.items() if "planner" in p}
        if planned:
            lines += ["", "| pool (planner) | role | SLA attainment | replica-hours | workers mean / max |",
                      "|---|---|---:|---:|---:|"]
            for name, f in planned.items():
                for role, hours in f["replica_hours"].items():
                    lines.append(f"| {name or '(default)'} | {role} | {f['sla_attainment']:.2%} | {hours:.3f} | "
                                 f"{f['mean_workers'][role]:.2f} / {f['max_workers'][role]} |")
    lines += ["", "| latency (ms) | p50 | p90 | p99 | mean | count |", "|---|---:|---:|---:|---:|---:|"]
    for name, s in (("TTFT", r.ttft_ms), ("ITL", r.itl_ms), ("TPOT", r.tpot_ms), ("e2e", r.e2e_ms),
                    ("queue", r.queue_ms)):
        lines.append(f"| {name} | {_f(s.p50)} | {_f(s.p90)} | {_f(s.p99)} | {_f(s.mean)} | {s.count:,} |")
    lines += ["", "| worker | requests | prompt tokens | hit rate | output tokens | busy |",
              "|---|---:|---:|---:|---:|---:|"]
    for w in r.per_worker:
        busy = "–" if w.busy_fraction is None else f"{w.busy_fraction:.1%}"
        lines.append(f"| {w.worker_id} | {w.requests:,} | {w.prompt_tokens:,} | {w.prefix_hit_rate:.1%} | "
                     f"{w.output_tokens:,} | {busy} |")
    return "\n".join(lines) + "\n"
