"""The SLA planner's decision core. This module does zero I/O.

One entry point: ``on_tick(state, tick) -> (state, effects)``. The adapter
(the Kafka loop live, the simulator in replay, a test) queries the last
interval's traffic, builds a :class:`TickInput`, calls :func:`on_tick`, and
publishes :func:`scaling_commands` of the returned :class:`PlannerEffects`.
The old state is never mutated, so a tick can be replayed or inspected.

Per tick, for each pool:

1. **Observe.** Feed the interval's request rate, mean ISL and mean OSL to the
   load predictors; note the KV hit rate (cached / ISL tokens).
2. **Correct.** ``correction = observed latency / expected latency``, where
   the expected latency is what the profile predicts at the per-replica load
   just served (prefill: TTFT at ``rate * effective ISL / replicas`` tokens/s;
   decode: ITL at ``rate * OSL / replicas`` tokens/s). The observed latency
   is the interval's mean, or its p99 when the pool's statistic is ``"p99"``
   (``ttft_statistic`` / ``itl_statistic``). It captures what the
   profile misses (queueing, interference, a slower machine) and, with p99,
   also the tail of live traffic over the profile's mean, so the target is
   then met by 99% of requests rather than on average. It is optionally
   smoothed over intervals (``correction_smoothing``, an exponential moving
   average) and is clamped to ``[correction_min, correction_max]``. Without traffic, or when a replica
   was loaded past the profile's peak throughput (its latency then measures
   its queue), the last factor stays.
3. **Size.** Predict next interval's rate, ISL and OSL; divide the latency
   target by the correction; take the profile's best per-replica throughput
   meeting that corrected target
   (:meth:`~kvflow.planner.interpolation.LatencySurface.best`):

   * prefill replicas = ``ceil(rate * ISL * (1 - hit rate) / prefill tokens/s per replica)``
   * decode replicas = ``ceil(rate * OSL / decode tokens/s per replica)``, at
     context length ``ISL + OSL / 2`` (mean context over a request's decode).
   * aggregated mode: one pool. ``aggregated_sizing="max"`` (default) takes
     ``ceil(max(prefill need, decode need))``: the lower bound, exact when
     decode tokens ride along in prefill steps (chunked prefill) at no cost.
     ``"sum"`` takes ``ceil(prefill need + decode need)``: the upper bound,
     when a replica's time is strictly shared between the two phases.

   In disaggregated mode the prefill pool may see other requests than the
   decode pool (:attr:`TickInput.prefill_traffic`: remote prefills only, or
   the requests a pool grid sends there): it is then observed, corrected and
   forecast from its own requests, with its own predictors.

4. **Bound.** Raise to the pool's minimum; apply anti-flapping: scale **up**
   at once to the need without corrections, and beyond it by at most
   ``max_scale_up_factor`` per tick; scale **down** only after the need stayed below the current
   target for ``scale_down_hold_intervals`` consecutive ticks, then to the
   highest need of the last ``scale_down_hold_intervals`` ticks; while the
   need stays below, every later tick steps down again to the highest need
   of its own last ``scale_down_hold_intervals`` ticks (a sliding window, as
   the Kubernetes HPA's scale-down stabilization window), so a pool falls
   from a burst's size to the quiet need in one hold, not one hold per step. Finally fit the GPU budget
   (``max_gpus``, each replica costing ``<pool>_gpus_per_replica``): while over
   budget, remove one replica from the pool that keeps the largest share of
   its target (never below its minimum).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from kvflow.planner.interpolation import LatencySurface, OperatingPoint, PerfSource
from kvflow.planner.predictors import PREDICTORS, LoadPredictor, make_predictor
from kvflow.schemas.scaling import ScalingCommand
from kvflow.schemas.workers import WorkerRole

__all__ = [
    "LATENCY_STATISTICS", "PlannerMode", "PlannerConfig", "TrafficObservation", "TickInput", "Prediction",
    "PoolDecision", "PlannerEffects", "LoadPredictors", "PlannerState", "initial_state", "on_tick", "scaling_commands",
    "pool_needs", "lead_steps", "fit_budget", "window_corrections",
]

_EPS = 1e-9
_STARTING_SHARE = 0.75  # below this share of replicas serving, an interval does not update corrections

LATENCY_STATISTICS = ("mean", "p99")
"""Statistics of an interval's per-request latencies the targets may apply to."""


class PlannerMode(str, Enum):
    """``disaggregated``: separate prefill and decode pools; ``aggregated``: one pool doing both."""

    aggregated = "aggregated"
    disaggregated = "disaggregated"


@dataclass(frozen=True)
class PlannerConfig:
    """SLA planner settings. Invalid values raise ``ValueError`` at construction.

    Attributes:
        ttft_ms: TTFT target, ms. Defaults to 500.
        itl_ms: ITL target, ms. Defaults to 50.
        adjustment_interval_s: seconds between ticks (the adapter schedules
            them; the core uses each observation's own duration). Defaults to 60.
        mode: pools to size. Defaults to disaggregated.
        predictor: load predictor name (:data:`~kvflow.planner.predictors.PREDICTORS`).
            Defaults to ``"constant"``.
        predictor_kwargs: constructor arguments for every load predictor.
        min_prefill_replicas / min_decode_replicas / min_aggregated_replicas:
            lower bounds per pool. Default 1 each.
        prefill_gpus_per_replica / decode_gpus_per_replica /
            aggregated_gpus_per_replica: GPUs one replica uses. Default 1 each.
        max_gpus: GPUs all pools may use together (with 1 GPU per replica this
            is the total replica cap). Defaults to 8.
        scale_down_hold_intervals: consecutive ticks a lower need must persist
            before scaling down. Defaults to 3.
        correction_min / correction_max: clamp of the correction factors.
            Default 0.5 and 4.0.
        aggregated_sizing: ``"max"`` or ``"sum"`` of prefill and decode needs
            in aggregated mode (see module docstring). Defaults to ``"max"``.
        correction_smoothing: weight in (0, 1] of the newest interval's
            correction in an exponential moving average of the factors
            (``c = w * observed + (1 - w) * c``); 1 uses each interval's factor
            as is. Short intervals hold few requests, so their mean latency is
            noisy; smoothing keeps one noisy interval from resizing the pool.
            Defaults to 1.
        max_scale_up_factor: growth beyond the need computed *without*
            correction factors is limited to ``max(previous + 1,
            ceil(previous * factor))`` per tick (>= 1; None: no cap); growth
            the predicted demand alone calls for happens at once. A
            correction measured on briefly overloaded replicas (a burst, or
            new replicas still loading) mostly measures their queue; near the
            profile's latency floor it multiplies the need many times over.
            Growing in bounded steps lets the next interval measure the
            bigger pool first. Defaults to 2.
        ttft_statistic / itl_statistic: ``"mean"`` or ``"p99"``: which
            statistic of the interval's per-request TTFT / ITL must meet
            ``ttft_ms`` / ``itl_ms``. The profile holds mean latencies of a
            steady closed-loop load; live arrivals are bursty and mix short
            and long prompts, so at the same mean some requests wait behind a
            long prefill. With ``"mean"`` the target is a mean, and meeting a
            per-request SLA needs a target below it (a margin to tune); with
            ``"p99"`` the correction factor is ``observed p99 / profile
            mean`` and the target can be the SLA threshold itself. An
            interval's p99 over a few hundred requests is noisy: pair it with
            ``correction_smoothing`` (0.5 in the documented offline run).
            Default ``"mean"`` for both.
        worker_startup_s: seconds from a scale-up decision until the new
            replica serves (process start, model load, registration): the
            planner's lead time when nothing measured it yet
            (:attr:`TickInput.startup_s` overrides it). Load is forecast
            ``1 + startup / interval`` intervals ahead, where the replica
            added now starts to matter. Defaults to 0.
        reactive_window_s: window of the fast reactive path
            (:mod:`kvflow.planner.reactive`): recent arrivals over this many
            seconds size the pool between ticks. Defaults to 5.
        reactive_jump: the fast path scales up on demand alone when the
            recent arrivals need at least this many times the current target
            (>= 1); with a backlog signal (requests waiting past the TTFT
            target, observed TTFT/ITL above target) any excess scales up.
            Defaults to 1.5: Poisson noise over 5 s at a few requests/s
            stays below it.
        reactive_step_window_s: the fast path also reads the arrival rate
            of the window's last this many seconds (0: only the whole
            window), as a lower bound of the Poisson rate behind that count
            (:func:`kvflow.planner.reactive.step_rate_lower_bound`), so a
            step of several times the rate is sized within these seconds
            and noise is not. Defaults to 2.
    """

    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    adjustment_interval_s: float = 60.0
    mode: PlannerMode = PlannerMode.disaggregated
    predictor: str = "constant"
    predictor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    min_prefill_replicas: int = 1
    min_decode_replicas: int = 1
    min_aggregated_replicas: int = 1
    prefill_gpus_per_replica: int = 1
    decode_gpus_per_replica: int = 1
    aggregated_gpus_per_replica: int = 1
    max_gpus: int = 8
    scale_down_hold_intervals: int = 3
    correction_min: float = 0.5
    correction_max: float = 4.0
    aggregated_sizing: str = "max"
    correction_smoothing: float = 1.0
    max_scale_up_factor: float | None = 2.0
    ttft_statistic: str = "mean"
    itl_statistic: str = "mean"
    worker_startup_s: float = 0.0
    reactive_window_s: float = 5.0
    reactive_jump: float = 1.5
    reactive_step_window_s: float = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", PlannerMode(self.mode))
        problems = []
        if self.ttft_ms <= 0 or self.itl_ms <= 0 or self.adjustment_interval_s <= 0:
            problems.append("ttft_ms, itl_ms and adjustment_interval_s must be > 0")
        if self.predictor not in PREDICTORS:
            problems.append(f"predictor must be one of {sorted(PREDICTORS)}")
        if min(self.min_prefill_replicas, self.min_decode_replicas, self.min_aggregated_replicas) < 0:
            problems.append("minimum replicas must be >= 0")
        if min(self.prefill_gpus_per_replica, self.decode_gpus_per_replica, self.aggregated_gpus_per_replica) < 1:
            problems.append("GPUs per replica must be >= 1")
        if self.scale_down_hold_intervals < 1:
            problems.append("scale_down_hold_intervals must be >= 1")
        if not (0 < self.correction_min <= 1 <= self.correction_max):
            problems.append("need 0 < correction_min <= 1 <= correction_max")
        if self.max_scale_up_factor is not None and not self.max_scale_up_factor >= 1:
            problems.append("max_scale_up_factor must be >= 1 (or None)")
        if not 0 < self.correction_smoothing <= 1:
            problems.append("correction_smoothing must be in (0, 1]")
        if self.ttft_statistic not in LATENCY_STATISTICS or self.itl_statistic not in LATENCY_STATISTICS:
            problems.append(f"ttft_statistic and itl_statistic must be one of {LATENCY_STATISTICS}")
        if self.worker_startup_s < 0 or self.reactive_window_s <= 0 or self.reactive_jump < 1:
            problems.append("need worker_startup_s >= 0, reactive_window_s > 0 and reactive_jump >= 1")
        if not 0 <= self.reactive_step_window_s <= self.reactive_window_s:
            problems.append("need 0 <= reactive_step_window_s <= reactive_window_s")
        if self.aggregated_sizing not in ("max", "sum"):
            problems.append("aggregated_sizing must be 'max' or 'sum'")
        floor_gpus = sum(self.min_replicas(p) * self.gpus_per_replica(p) for p in self.pools)
        if floor_gpus > self.max_gpus:
            problems.append(f"minimum replicas need {floor_gpus} GPUs > max_gpus={self.max_gpus}")
        if problems:
            raise ValueError("invalid PlannerConfig: " + "; ".join(problems))

    @property
    def pools(self) -> tuple[WorkerRole, ...]:
        """Pools this mode sizes, in decision order."""
        if self.mode is PlannerMode.aggregated:
            return (WorkerRole.aggregated,)
        return (WorkerRole.prefill, WorkerRole.decode)

    def min_replicas(self, pool: WorkerRole) -> int:
        """Lower bound of ``pool``."""
        return getattr(self, f"min_{WorkerRole(pool).value}_replicas")

    def gpus_per_replica(self, pool: WorkerRole) -> int:
        """GPUs one replica of ``pool`` uses."""
        return getattr(self, f"{WorkerRole(pool).value}_gpus_per_replica")


@dataclass(frozen=True)
class TrafficObservation:
    """Traffic over the interval that just ended.

    ``num_requests`` finished in ``duration_s`` seconds; means and 99th
    percentiles are over those requests (``None`` when there were none):
    ISL/OSL/cached in tokens, latencies in ms (the percentiles matter only to
    a ``"p99"`` statistic of :class:`PlannerConfig`). Built from ClickHouse by
    :meth:`kvflow.planner.queries.IntervalAggregates.to_observation`.
    """

    duration_s: float
    num_requests: int
    mean_isl: float | None = None
    mean_osl: float | None = None
    mean_ttft_ms: float | None = None
    mean_itl_ms: float | None = None
    mean_cached_tokens: float | None = None
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None

    @property
    def request_rate_per_s(self) -> float:
        """Finished requests per second."""
        return self.num_requests / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class TickInput:
    """What the adapter hands the core each tick.

    ``now_ms``: tick time, epoch ms (wall or simulated clock).
    ``current_replicas``: replicas per pool now running, including ones still
    starting (a missing pool counts 0); scaling decisions start from these.
    ``serving_replicas``: replicas per pool that took requests during the
    interval just observed (None: the same as ``current_replicas``). The
    correction factors divide the observed load by these: a replica still
    loading its model served nothing, and counting it would make the
    observed latency look like a profile error and over-correct. It may be
    fractional (a time-weighted mean over the interval). A pool that served
    with less than 3/4 of the replicas it now runs (a burst's scale-up still
    starting) keeps its correction: its latency then measured the missing
    capacity, which the planner already added, not an error of the profile.
    A smaller shortfall (one replica of a ramp) still updates it, divided by
    the replicas that served.
    ``startup_s``: measured seconds from a scale-up to the new replica
    serving (None: :attr:`PlannerConfig.worker_startup_s`).
    ``waiting_requests``: requests accepted and not yet served (held by the
    router, e.g. for a pool at zero): demand no finished request shows
    yet. While any wait, a pool that serves whole requests (aggregated, or
    decode) is not sized below one replica, so a pool scaled to zero is not
    scaled down again before its first worker serves them.
    ``prefill_traffic``: disaggregated mode only: the interval's requests
    whose prompt the prefill pool computed (remote prefills), when they
    differ from ``traffic`` (the requests the decode pool served, which
    then sizes decode only). A pool of a global router's grid
    (:mod:`kvflow.router.pools`) prefills some requests another pool
    decodes, and with conditional disaggregation short prompts never reach
    the prefill pool. None: ``traffic`` sizes both.
    """

    now_ms: int
    traffic: TrafficObservation
    current_replicas: Mapping[WorkerRole, int] = field(default_factory=dict)
    serving_replicas: Mapping[WorkerRole, float] | None = None
    startup_s: float | None = None
    waiting_requests: int = 0
    prefill_traffic: TrafficObservation | None = None


@dataclass(frozen=True)
class Prediction:
    """Next interval's predicted load: requests/s, mean ISL and OSL (tokens,
    ``None`` before any traffic), and the KV hit rate (fraction of prompt
    tokens served from cache; last observed value)."""

    request_rate_per_s: float
    isl: float | None
    osl: float | None
    kv_hit_rate: float


@dataclass(frozen=True)
class PoolDecision:
    """The planner's decision for one pool.

    ``needed_replicas`` is what the load requires (after the minimum);
    ``target_replicas`` what to run now (after anti-flapping and the GPU
    budget). ``demand_tokens_per_s`` is the pool's predicted token load and
    ``point`` the per-replica operating point it was sized with (``None``
    without load).
    """

    pool: WorkerRole
    current_replicas: int
    needed_replicas: int
    target_replicas: int
    demand_tokens_per_s: float
    point: OperatingPoint | None
    reason: str

    @property
    def changed(self) -> bool:
        """Whether the target differs from what runs now."""
        return self.target_replicas != self.current_replicas


@dataclass(frozen=True)
class PlannerEffects:
    """What one tick decided: a target per pool, the prediction it used, and
    the correction factors (observed / expected latency) it applied."""

    now_ms: int
    next_tick_ms: int
    decisions: tuple[PoolDecision, ...]
    prediction: Prediction
    prefill_correction: float
    decode_correction: float

    def target(self, pool: WorkerRole) -> int:
        """Target replicas of ``pool``.

        Raises:
            KeyError: ``pool`` is not planned in this mode.
        """
        for d in self.decisions:
            if d.pool == pool:
                return d.target_replicas
        raise KeyError(pool)


@dataclass(frozen=True)
class LoadPredictors:
    """One predictor per load signal: request rate (req/s), mean ISL, mean OSL (tokens)."""

    rate: LoadPredictor
    isl: LoadPredictor
    osl: LoadPredictor


@dataclass(frozen=True)
class PlannerState:
    """Everything the core carries between ticks (treat as immutable).

    ``targets``: last target per pool (absent before the first tick);
    ``down_runs``: needs below target seen on consecutive ticks, per pool;
    ``prefill_predictors``: the prefill pool's own load predictors, once a
    tick gave :attr:`TickInput.prefill_traffic` (None before);
    ``demand_scale_up_ms``: when the fast path last scaled a pool up because
    its arrivals needed more replicas than ran (None: never). An interval
    that saw one leaves the correction factors as they were: its latencies
    measured the missing capacity (requests queued before the added
    replicas served), not the profile's error, as with replicas still
    starting (``_STARTING_SHARE``).
    """

    config: PlannerConfig
    perf: PerfSource
    predictors: LoadPredictors
    targets: Mapping[WorkerRole, int] = field(default_factory=dict)
    down_runs: Mapping[WorkerRole, tuple[int, ...]] = field(default_factory=dict)
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    kv_hit_rate: float = 0.0
    num_ticks: int = 0
    prefill_predictors: LoadPredictors | None = None
    demand_scale_up_ms: int | None = None


def initial_state(config: PlannerConfig, perf: PerfSource) -> PlannerState:
    """A fresh planner: empty predictors, corrections 1.0, no targets yet.

    Raises:
        ImportError: ``config.predictor`` is ``"prophet"`` without the optional package.
    """
    return PlannerState(config=config, perf=perf, predictors=_new_predictors(config))


def _new_predictors(config: PlannerConfig) -> LoadPredictors:
    def new() -> LoadPredictor:
        return make_predictor(config.predictor, **dict(config.predictor_kwargs))
    return LoadPredictors(new(), new(), new())


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def _observe(preds: LoadPredictors, traffic: TrafficObservation) -> None:
    preds.rate.observe(traffic.request_rate_per_s)
    if traffic.num_requests > 0:
        if traffic.mean_isl is not None:
            preds.isl.observe(traffic.mean_isl)
        if traffic.mean_osl is not None:
            preds.osl.observe(traffic.mean_osl)


def _hit_rate(traffic: TrafficObservation, previous: float) -> float:
    if traffic.num_requests > 0 and traffic.mean_isl and traffic.mean_cached_tokens is not None:
        return _clamp(traffic.mean_cached_tokens / traffic.mean_isl, 0.0, 1.0)
    return previous


def _correction(surface: LatencySurface, length: float, load_tokens_per_s: float, observed_ms: float,
                previous: float, cfg: PlannerConfig) -> float:
    """Observed / expected latency at one replica's load; ``previous`` when the
    replica was past the profile's peak throughput (its latency then measures
    its queue, not the profile's error, and the demand term already adds replicas)."""
    if load_tokens_per_s > surface.max_throughput(length):
        return previous
    expected = surface.latency_at_throughput(length, load_tokens_per_s)
    w = cfg.correction_smoothing
    return _clamp(w * (observed_ms / expected) + (1.0 - w) * previous, cfg.correction_min, cfg.correction_max)


def window_corrections(state: PlannerState, traffic: TrafficObservation,
                       serving_replicas: Mapping[WorkerRole, float]) -> tuple[float, float]:
    """The prefill and decode correction factors the interval path would take from
    ``traffic`` served by ``serving_replicas`` (same formula, smoothing and clamp as
    step 2 of the module docstring), without storing them: the fast path sizes a
    pressure step with them (:mod:`kvflow.planner.reactive`) before the first
    interval has corrected anything.

    Raises:
        ValueError: the profile has no feasible point at the traffic's lengths.
    """
    tick = TickInput(now_ms=0, traffic=traffic, current_replicas=serving_replicas)
    return _corrections_from(state, tick, traffic, traffic, _hit_rate(traffic, state.kv_hit_rate))


def _corrections(state: PlannerState, tick: TickInput, hit_rate: float) -> tuple[float, float]:
    """Prefill (TTFT) and decode (ITL) correction factors from the interval just served
    (each from its own pool's requests when :attr:`TickInput.prefill_traffic` is given)."""
    if tick.prefill_traffic is None:
        return _corrections_from(state, tick, tick.traffic, tick.traffic, hit_rate)
    p_corr, _ = _corrections_from(state, tick, tick.prefill_traffic, None, hit_rate)
    _, d_corr = _corrections_from(state, tick, None, tick.traffic, state.kv_hit_rate)
    return p_corr, d_corr


def _corrections_from(state: PlannerState, tick: TickInput, pt: TrafficObservation | None,
                      dt: TrafficObservation | None, hit_rate: float) -> tuple[float, float]:
    """Correction factors from prefill traffic ``pt`` and decode traffic ``dt`` (None: keep that factor)."""
    cfg, perf = state.config, state.perf
    p_corr, d_corr = state.prefill_correction, state.decode_correction
    agg = cfg.mode is PlannerMode.aggregated
    served = tick.current_replicas if tick.serving_replicas is None else tick.serving_replicas
    p_pool, d_pool = (WorkerRole.aggregated, WorkerRole.aggregated) if agg else (WorkerRole.prefill, WorkerRole.decode)
    n_p, n_d = served.get(p_pool, 0), served.get(d_pool, 0)
    if n_p < _STARTING_SHARE * tick.current_replicas.get(p_pool, 0):
        n_p = 0  # many replicas were starting: keep the correction (see TickInput)
    if n_d < _STARTING_SHARE * tick.current_replicas.get(d_pool, 0):
        n_d = 0
    if pt is not None and pt.num_requests > 0 and pt.mean_isl and n_p > 0:
        eff_isl = max(1.0, pt.mean_isl * (1.0 - hit_rate))
        ttft = pt.p99_ttft_ms if cfg.ttft_statistic == "p99" else pt.mean_ttft_ms
        if ttft is not None:
            p_corr = _correction(perf.at_osl(pt.mean_osl).prefill, eff_isl, pt.request_rate_per_s * eff_isl / n_p,
                                 ttft, p_corr, cfg)
    if dt is not None and dt.num_requests > 0 and dt.mean_isl and dt.mean_osl and n_d > 0:
        itl = dt.p99_itl_ms if cfg.itl_statistic == "p99" else dt.mean_itl_ms
        if itl is not None:
            d_corr = _correction(perf.at_osl(dt.mean_osl).decode, dt.mean_isl + dt.mean_osl / 2,
                                 dt.request_rate_per_s * dt.mean_osl / n_d,
                                 itl, d_corr, cfg)
    return p_corr, d_corr


def _predict(preds: LoadPredictors, hit_rate: float, steps: float = 1.0) -> Prediction:
    """Load ``steps`` intervals ahead (the lead time); lengths one step ahead."""
    def maybe(p: LoadPredictor) -> float | None:
        return max(0.0, p.predict()) if p.num_observations else None
    rate = max(preds.rate.predict(), preds.rate.predict_ahead(steps)) if steps > 1 else preds.rate.predict()
    return Prediction(request_rate_per_s=max(0.0, rate), isl=maybe(preds.isl), osl=maybe(preds.osl),
                      kv_hit_rate=hit_rate)


def lead_steps(cfg: PlannerConfig, startup_s: float | None) -> float:
    """Intervals ahead a replica added now must be sized for: ``1 + startup / interval``."""
    startup = cfg.worker_startup_s if startup_s is None else max(0.0, startup_s)
    return 1.0 + startup / cfg.adjustment_interval_s


@dataclass(frozen=True)
class _Need:
    replicas: float  # fractional
    demand_tokens_per_s: float
    point: OperatingPoint | None
    note: str


def _phase_needs(state: PlannerState, pred: Prediction, p_corr: float, d_corr: float,
                 p_pred: Prediction | None = None) -> tuple[_Need, _Need]:
    """Fractional prefill and decode replicas for the predicted load (``p_pred``: the
    prefill pool's own, when it differs from ``pred``)."""
    if p_pred is not None:
        if p_pred.osl is None and p_pred.isl is not None:
            p_pred = replace(p_pred, osl=1.0)  # prefill sizing reads no output length
        return _phase_needs(state, p_pred, p_corr, d_corr)[0], _phase_needs(state, pred, p_corr, d_corr)[1]
    cfg = state.config
    if pred.request_rate_per_s <= 0 or pred.isl is None or pred.osl is None:
        idle = _Need(0.0, 0.0, None, "no predicted load")
        return idle, idle
    perf = state.perf.at_osl(pred.osl)  # the profile of the predicted output length (PerfFamily)
    rate = pred.request_rate_per_s
    eff_isl = max(1.0, pred.isl * (1.0 - pred.kv_hit_rate))
    ttft_goal = cfg.ttft_ms / p_corr
    p_point = perf.prefill.best(eff_isl, ttft_goal)
    p_demand = rate * eff_isl
    prefill = _Need(p_demand / p_point.throughput_tokens_per_s, p_demand, p_point,
                    f"{rate:.2f} req/s x {eff_isl:.0f} new tok = {p_demand:.0f} tok/s; "
                    f"{p_point.throughput_tokens_per_s:.0f} tok/s/replica at TTFT {p_point.latency_ms:.1f} ms "
                    f"(goal {ttft_goal:.1f} = {cfg.ttft_ms:g}/{p_corr:.2f}"
                    f"{'' if p_point.meets_target else ', unreachable'})")
    itl_goal = cfg.itl_ms / d_corr
    d_point = perf.decode.best(pred.isl + pred.osl / 2, itl_goal)
    d_demand = rate * pred.osl
    decode = _Need(d_demand / d_point.throughput_tokens_per_s, d_demand, d_point,
                   f"{rate:.2f} req/s x {pred.osl:.0f} out tok = {d_demand:.0f} tok/s; "
                   f"{d_point.throughput_tokens_per_s:.0f} tok/s/replica at ITL {d_point.latency_ms:.2f} ms "
                   f"(goal {itl_goal:.2f} = {cfg.itl_ms:g}/{d_corr:.2f}"
                   f"{'' if d_point.meets_target else ', unreachable'})")
    return prefill, decode


def pool_needs(state: PlannerState, pred: Prediction, p_corr: float | None = None,
               d_corr: float | None = None) -> dict[WorkerRole, tuple[float, str]]:
    """Fractional replicas per pool for load ``pred`` and a note on how.

    Corrections default to the state's. Prefill is sized from the uncached
    prompt tokens/s against the TTFT target, decode from the output tokens/s
    against the ITL target, so the ISL/OSL mix decides which phase limits
    (see the module docstring).

    Raises:
        ValueError: the profile has no feasible point at the predicted lengths.
    """
    p = state.prefill_correction if p_corr is None else p_corr
    d = state.decode_correction if d_corr is None else d_corr
    needs = _pool_needs(state.config, *_phase_needs(state, pred, p, d))
    return {pool: (n.replicas, n.note) for pool, n in needs.items()}


def _pool_needs(cfg: PlannerConfig, prefill: _Need, decode: _Need) -> dict[WorkerRole, _Need]:
    if cfg.mode is PlannerMode.disaggregated:
        return {WorkerRole.prefill: prefill, WorkerRole.decode: decode}
    combine = max if cfg.aggregated_sizing == "max" else (lambda a, b: a + b)
    limiting = decode if decode.replicas >= prefill.replicas else prefill
    return {WorkerRole.aggregated: _Need(
        combine(prefill.replicas, decode.replicas), prefill.demand_tokens_per_s + decode.demand_tokens_per_s,
        limiting.point,
        f"{cfg.aggregated_sizing}(prefill {prefill.replicas:.2f}, decode {decode.replicas:.2f}); "
        f"prefill: {prefill.note}; decode: {decode.note}")}


def _hold(cfg: PlannerConfig, previous: int, need: int, run: tuple[int, ...],
          demand_need: int | None = None) -> tuple[int, tuple[int, ...], str]:
    """Anti-flapping: up at once to ``demand_need`` (the need without corrections; None =
    ``need``) and beyond it by at most ``max_scale_up_factor`` per tick; down after
    ``scale_down_hold_intervals`` lower ticks."""
    if need > previous:
        f = cfg.max_scale_up_factor
        if f is None or demand_need is None:
            return need, (), f"scale up {previous} -> {need}"
        step = min(need, max(demand_need, previous + 1, math.ceil(previous * f - _EPS)))
        capped = f" (need {need}, {demand_need} before corrections; at most x{f:g} per tick)" if step < need else ""
        return step, (), f"scale up {previous} -> {step}{capped}"
    if need == previous:
        return need, (), f"hold at {need}"
    hold = cfg.scale_down_hold_intervals
    run = (run + (need,))[-hold:]
    if len(run) >= hold:
        # The window slides: each later tick below target steps down again to the
        # highest need of the last ``hold`` ticks, without waiting a new full hold.
        target = max(run)
        if target < previous:
            return target, run, f"scale down {previous} -> {target}: highest need of the last {hold} intervals"
        return previous, run, f"hold at {previous}: highest need of the last {hold} intervals is {target}"
    return previous, run, f"hold at {previous}: need {need} for {len(run)}/{hold} intervals"


def fit_budget(cfg: PlannerConfig, targets: dict[WorkerRole, int]) -> dict[WorkerRole, int]:
    """Trim ``targets`` to ``max_gpus``, one replica at a time from the pool
    keeping the largest share of its target; never below a pool's minimum."""
    fitted = dict(targets)
    def gpus() -> int:
        return sum(n * cfg.gpus_per_replica(p) for p, n in fitted.items())
    while gpus() > cfg.max_gpus:
        trimmable = [p for p in cfg.pools if fitted[p] > cfg.min_replicas(p)]
        pool = max(trimmable, key=lambda p: (fitted[p] / targets[p], fitted[p]))
        fitted[pool] -= 1
    return fitted


def on_tick(state: PlannerState, tick: TickInput) -> tuple[PlannerState, PlannerEffects]:
    """Advance the planner by one interval.

    Args:
        state: the state returned by the previous call (or :func:`initial_state`).
        tick: the interval's traffic and the replicas now running.

    Returns:
        The new state and the effects (targets per pool with reasons). The
        input ``state`` is left unchanged.

    Raises:
        ValueError: the profile has no feasible point at the predicted lengths.
    """
    cfg = state.config
    if tick.prefill_traffic is not None and cfg.mode is not PlannerMode.disaggregated:
        raise ValueError("prefill_traffic sizes a prefill pool: disaggregated mode only")
    preds = copy.deepcopy(state.predictors)
    _observe(preds, tick.traffic)
    steps = lead_steps(cfg, tick.startup_s)
    p_preds, p_pred = state.prefill_predictors, None
    if tick.prefill_traffic is not None:
        p_preds = copy.deepcopy(p_preds) if p_preds is not None else _new_predictors(cfg)
        _observe(p_preds, tick.prefill_traffic)
        hit_rate = _hit_rate(tick.prefill_traffic, state.kv_hit_rate)
        p_pred = _predict(p_preds, hit_rate, steps)
    else:
        hit_rate = _hit_rate(tick.traffic, state.kv_hit_rate)
    interval_start_ms = tick.now_ms - 1000.0 * tick.traffic.duration_s
    if state.demand_scale_up_ms is not None and state.demand_scale_up_ms >= interval_start_ms:
        p_corr, d_corr = state.prefill_correction, state.decode_correction  # see PlannerState
    else:
        p_corr, d_corr = _corrections(state, tick, hit_rate)
    pred = _predict(preds, hit_rate, steps)
    needs = _pool_needs(cfg, *_phase_needs(state, pred, p_corr, d_corr, p_pred))
    uncorrected = _pool_needs(cfg, *_phase_needs(state, pred, 1.0, 1.0, p_pred))

    raw: dict[WorkerRole, int] = {}
    held: dict[WorkerRole, int] = {}
    runs: dict[WorkerRole, tuple[int, ...]] = {}
    notes: dict[WorkerRole, str] = {}
    for pool in cfg.pools:
        current = int(tick.current_replicas.get(pool, 0))
        floor = cfg.min_replicas(pool)
        if tick.waiting_requests > 0 and pool in (WorkerRole.aggregated, WorkerRole.decode):
            floor = max(floor, 1)
        raw[pool] = max(floor, _ceil(needs[pool].replicas))
        previous = state.targets.get(pool, current)
        demand = max(floor, _ceil(uncorrected[pool].replicas))
        held[pool], runs[pool], notes[pool] = _hold(cfg, previous, raw[pool], state.down_runs.get(pool, ()), demand)
    targets = fit_budget(cfg, held)

    decisions = []
    for pool in cfg.pools:
        reason = f"{pool.value}: {notes[pool]}; need {needs[pool].replicas:.2f} -> {raw[pool]} ({needs[pool].note})"
        if raw[pool] > max(cfg.min_replicas(pool), _ceil(needs[pool].replicas)):
            reason += f"; {tick.waiting_requests} requests wait: at least 1 replica (cold start)"
        if targets[pool] != held[pool]:
            reason += f"; GPU budget {cfg.max_gpus} caps {held[pool]} -> {targets[pool]}"
        decisions.append(PoolDecision(
            pool=pool, current_replicas=int(tick.current_replicas.get(pool, 0)), needed_replicas=raw[pool],
            target_replicas=targets[pool], demand_tokens_per_s=needs[pool].demand_tokens_per_s,
            point=needs[pool].point, reason=reason))

    new_state = replace(state, predictors=preds, targets=targets, down_runs=runs, prefill_correction=p_corr,
                        decode_correction=d_corr, kv_hit_rate=hit_rate, num_ticks=state.num_ticks + 1,
                        prefill_predictors=p_preds)
    effects = PlannerEffects(
        now_ms=tick.now_ms, next_tick_ms=tick.now_ms + int(cfg.adjustment_interval_s * 1000),
        decisions=tuple(decisions), prediction=pred, prefill_correction=p_corr, decode_correction=d_corr)
    return new_state, effects


def scaling_commands(effects: PlannerEffects, *, only_changed: bool = True,
                     shadow: bool = False, worker_pool: str = "") -> list[ScalingCommand]:
    """Scaling records for a tick's decisions.

    ``decision_id`` is ``"<now_ms>-<pool>"`` (``"<now_ms>-<worker_pool>-<pool>"``
    for a named worker pool): deterministic, so a replayed or re-published
    tick yields the same ids and connectors (which apply each id at most
    once) ignore the duplicates, while every tick gets new ids.

    Args:
        effects: the tick's effects.
        only_changed: emit only pools whose target differs from what runs now.
        shadow: mark the records advisory (:attr:`ScalingCommand.shadow`):
            connectors log them and act on none.
        worker_pool: the worker pool these effects size (:attr:`ScalingCommand.worker_pool`).
    """
    prefix = f"{effects.now_ms}-{worker_pool}-" if worker_pool else f"{effects.now_ms}-"
    return [
        ScalingCommand(decision_id=f"{prefix}{d.pool.value}", pool=d.pool,
                       target_replicas=d.target_replicas, current_replicas=d.current_replicas,
                       reason=d.reason, ts_ms=effects.now_ms, shadow=shadow, worker_pool=worker_pool)
        for d in effects.decisions
        if d.changed or not only_changed
    ]
