"""The SLA planner inside offline replay, against static provisioning.

:class:`SlaPlannerHook` is the simulator-side adapter of the pure planner core
(:func:`kvflow.planner.core.on_tick`), the offline twin of the live
:class:`~kvflow.planner.loop.PlannerLoop`. Every ``adjustment_interval_s`` of
simulated time it:

1. aggregates the requests that **finished** in ``[t0, t1)`` exactly as the
   live loop's ClickHouse query does (:func:`interval_aggregates_from_records`:
   load statistics over every request, TTFT over successful ones, ITL as the
   mean of per-request mean ITL over successful requests with more than one
   output token); windows are contiguous, the first one starts at 0. The
   simulator has no Kafka or sink delay, so there is no settle margin;
2. counts the **serving** workers of the pool (draining ones are not counted,
   as the live ``workers_topic_counter`` does not count them);
3. calls ``on_tick`` and applies the target: new workers start at once with an
   empty cache; scaling down drains the newest serving workers (the local
   supervisor's order). A drained worker gets no new request and finishes the
   ones it holds (the simulator keeps stepping it; nothing is aborted).

Replica-hours (:func:`replica_hours`) integrate live workers over simulated
time: a worker is live from its start (0 for the initial pool) until the run
ends, or, once drained, until its last request finishes (at least the drain
time). The horizon is trace start (0) to the run's last event.

:func:`evaluate_planner` runs the planner on a trace and then the same trace
on static pools:

* **static peak** = the smallest static pool whose SLA attainment reaches
  ``sla_target``, found by bisection over ``[1, max_replicas]`` (attainment is
  taken to grow with the pool; every size simulated is reported so this can be
  checked). It is the cheapest fixed pool that meets the same goal, so the
  planner's saving is measured against a right-sized, not an oversized, pool.
  When even ``max_replicas`` misses the goal, static peak is ``max_replicas``
  and the summary says so.
* **static mean** = the planner run's time-weighted mean of live workers,
  rounded up: a fixed pool with (about) the planner's budget.

The planner sizes with a profile of the simulator's own engine settings
(:func:`profile_for`). ``phases`` is :func:`kvflow.planner.profile.run_profile`
(prefill and decode measured apart); ``aggregated``
(:func:`aggregated_mocker_profile`) measures both together in closed loop, as
an aggregated worker runs them. With ``phases`` the profile misses the
prefill chunks that stretch every decode step of an aggregated worker, so the
correction factor has to carry that error; it depends on the load per
replica, and the planner can swing between too few and too many workers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kvflow.planner.core import (
    PlannerConfig, PlannerMode, PlannerState, Prediction, TickInput, initial_state, on_tick, pool_needs,
)
from kvflow.planner.interpolation import PerfFamily, PerfModel, PerfSource
from kvflow.planner.profile import DecodeProfile, PrefillProfile, Profile, run_profile
from kvflow.planner.reactive import LiveSignals, on_signals
from kvflow.planner.queries import IntervalAggregates
from kvflow.replay.report import (
    PlannerSummary, PlannerTickPoint, ReplicaStep, RequestRecord, StaticRun, sla_attainment,
)
from kvflow.replay.simulator import SimConfig, SimResult, Simulation
from kvflow.replay.traces import Trace
from kvflow.schemas import SamplingParams, WorkerRole
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore

__all__ = [
    "SlaPlannerHook",
    "PlannerRun",
    "PlannerEvaluation",
    "interval_aggregates_from_records",
    "worker_lifetimes",
    "replica_hours",
    "replica_steps",
    "warm_start_replicas",
    "run_with_planner",
    "run_static",
    "smallest_static_pool",
    "evaluate_planner",
    "profile_for",
    "PROFILE_KINDS",
    "closed_loop_point",
    "closed_loop_stats",
    "aggregated_mocker_profile",
    "aggregated_mocker_profiles",
    "PROFILE_OSLS",
]

_MS_PER_HOUR = 3_600_000.0


def _done_ms(r: RequestRecord) -> float | None:
    """When ``r`` left the system: its finish, or its arrival if it failed before
    reaching an engine (the live bridge reports such failures at once); None while in flight."""
    if r.finish_ms is not None:
        return r.finish_ms
    return r.arrival_ms if r.error is not None else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _quantiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


def interval_aggregates_from_records(records: Iterable[RequestRecord], t0_ms: float,
                                     t1_ms: float) -> IntervalAggregates:
    """The live planner's window statistics, computed from replay records.

    Same conventions as :func:`kvflow.planner.queries.interval_aggregates`
    (requests that left the system in ``[t0_ms, t1_ms)``; load statistics over
    all of them; TTFT over successful ones; ITL = mean over successful
    requests with ``output_tokens > 1`` of their mean ITL, i.e. (last token −
    first token) / (output tokens − 1); numpy-default percentiles). OSL is the
    tokens actually delivered, as the live metrics record it.

    Args:
        records: replay records (times in ms from trace start).
        t0_ms, t1_ms: the half-open window, simulated ms.

    Raises:
        ValueError: ``t1_ms <= t0_ms``.
    """
    if t1_ms <= t0_ms:
        raise ValueError(f"empty window [{t0_ms}, {t1_ms})")
    window = [r for r in records if (d := _done_ms(r)) is not None and t0_ms <= d < t1_ms]
    ok = [r for r in window if r.ok and r.first_token_ms is not None]
    ttft = [r.first_token_ms - r.arrival_ms for r in ok]
    itl = [(r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1)
           for r in ok if r.output_tokens > 1 and r.last_token_ms is not None]
    ttft_q, itl_q = _quantiles(ttft), _quantiles(itl)
    return IntervalAggregates(
        t0_ms=int(t0_ms), t1_ms=int(t1_ms), num_requests=len(window), num_failed=len(window) - len(ok),
        mean_isl=_mean([r.isl for r in window]), mean_osl=_mean([r.output_tokens for r in window]),
        mean_cached_tokens=_mean([r.cached_tokens for r in window]),
        mean_ttft_ms=_mean(ttft), p50_ttft_ms=ttft_q[0], p99_ttft_ms=ttft_q[1],
        mean_itl_ms=_mean(itl), p50_itl_ms=itl_q[0], p99_itl_ms=itl_q[1],
    )


def _sim_records(sim: Simulation) -> list[RequestRecord]:
    # The simulator builds its records when the run starts and exposes them only
    # in the result; the adapter reads the live ones (read-only) each tick.
    return list(sim._records.values())


class SlaPlannerHook:
    """A :class:`~kvflow.replay.simulator.PlannerHook` running the SLA planner
    core on the simulated clock (see the module docstring).

    The simulator calls it every ``fast_interval_s`` (or every adjustment
    interval without a fast path). Every ``adjustment_interval_s`` it runs
    the interval tick (:func:`~kvflow.planner.core.on_tick`); in between, the
    fast reactive path (:func:`~kvflow.planner.reactive.on_signals`) on
    :meth:`signals`: arrivals of the last ``reactive_window_s`` seconds, the
    router's queue and the engines' waiting requests and prompt tokens, the
    oldest request still without a first token, and the p99 TTFT and ITL of
    requests finished in that window.

    The start-up time the planner plans with is measured as the live planner
    measures it: from a scale-up to the new worker serving (``ready_ms -
    start``), the mean of those seen so far (the configured
    ``worker_startup_s`` until the first one is ready).

    Args:
        config: planner settings; must be aggregated mode (the simulator runs
            aggregated workers). ``adjustment_interval_s`` is the tick period.
        perf: the profile the planner sizes with.
        fast_interval_s: seconds between fast-path checks; None: no fast path.

    Attributes:
        ticks: one :class:`PlannerTickPoint` per interval tick, in order.
        started_ms / drained_ms: worker id → simulated ms it was started /
            drained by the planner (initial workers are not in ``started_ms``).
        reactive_ms: simulated ms of every fast-path scale-up.
        state: the planner core's state after the last tick.

    Raises:
        ValueError: ``config.mode`` is not aggregated, or ``fast_interval_s <= 0``.
    """

    role = WorkerRole.aggregated

    def __init__(self, config: PlannerConfig, perf: PerfSource, *, fast_interval_s: float | None = 1.0) -> None:
        if config.mode is not PlannerMode.aggregated:
            raise ValueError("offline replay simulates aggregated workers; use PlannerConfig(mode='aggregated')")
        if fast_interval_s is not None and fast_interval_s <= 0:
            raise ValueError("fast_interval_s must be > 0 (or None)")
        self.config = config
        self.tick_ms = config.adjustment_interval_s * 1000.0
        self.interval_ms = self.tick_ms if fast_interval_s is None else min(self.tick_ms, fast_interval_s * 1000.0)
        self.state: PlannerState = initial_state(config, perf)
        self.ticks: list[PlannerTickPoint] = []
        self.started_ms: dict[str, float] = {}
        self.drained_ms: dict[str, float] = {}
        self.reactive_ms: list[float] = []
        self._window_start_ms = 0.0
        self._next_tick_ms = self.tick_ms
        self._pending: list[RequestRecord] | None = None
        self._arrivals: np.ndarray | None = None
        self._ready_samples: list[int] = []  # ready workers at each fast check of the interval

    def _window(self, sim: Simulation, t1_ms: float) -> list[RequestRecord]:
        """Records that left the system since the last tick (each is returned once)."""
        if self._pending is None:
            self._pending = _sim_records(sim)
        done, pending = [], []
        for r in self._pending:
            d = _done_ms(r)
            (done if d is not None and d < t1_ms else pending).append(r)
        self._pending = pending
        return done

    def _serving(self, sim: Simulation) -> list[str]:
        """Serving (not draining) worker ids of the pool, oldest first (ids are numbered in start order)."""
        return sorted((w.worker_id for w in sim.workers.values() if w.role == self.role and not w.draining),
                      key=lambda wid: (len(wid), wid))

    def measured_startup_s(self, sim: Simulation, now_ms: float) -> float | None:
        """Mean start-up time of the workers this hook started that serve by ``now_ms``, s (None: none yet)."""
        seen = [sim.workers[w].ready_ms - t for w, t in self.started_ms.items() if sim.workers[w].ready_ms <= now_ms]
        return sum(seen) / len(seen) / 1000.0 if seen else None

    def _apply(self, sim: Simulation, serving: list[str], target: int, now_ms: float) -> None:
        for _ in range(target - len(serving)):
            self.started_ms[sim.add_worker(self.role)] = now_ms
        for worker_id in reversed(serving[target:]):  # newest first
            sim.drain_worker(worker_id)
            self.drained_ms[worker_id] = now_ms

    def on_tick(self, now_ms: float, sim: Simulation) -> None:
        """An interval tick when one is due, else a fast-path check."""
        if now_ms + 1e-6 >= self._next_tick_ms:
            self._next_tick_ms += self.tick_ms
            self._interval_tick(now_ms, sim)
        else:
            self._fast_check(now_ms, sim)

    def signals(self, now_ms: float, sim: Simulation) -> LiveSignals:
        """The fast path's inputs at ``now_ms`` (see the class docstring)."""
        window_ms = self.config.reactive_window_s * 1000.0
        if self._arrivals is None:
            self._arrivals = np.fromiter((r.arrival_ms for r in sim.requests), dtype=np.float64)
        step_ms = self.config.reactive_step_window_s * 1000.0
        lo, mid, hi = np.searchsorted(self._arrivals, [now_ms - window_ms, now_ms - step_ms, now_ms], side="right")
        recent = sim.requests[lo:hi]
        # the router's held requests count as waiting (their age shows in oldest_wait_ms)
        waiting, tokens = (len(sim.core.queue) if sim.core.queue is not None else 0), 0
        for w in sim.workers.values():
            s = w.core.stats(w.pending)
            waiting += s.waiting_requests
            tokens += s.active_prefill_tokens
        if self._pending is None:
            self._pending = _sim_records(sim)
        oldest, ttft, itl = 0.0, [], []
        for r in self._pending:  # arrival order; finished ones leave at each interval tick
            if r.arrival_ms > now_ms:
                break
            if r.first_token_ms is None and r.error is None:
                oldest = max(oldest, now_ms - r.arrival_ms)
            elif r.finish_ms is not None and r.finish_ms >= now_ms - window_ms and r.first_token_ms is not None:
                ttft.append(r.first_token_ms - r.arrival_ms)
                if r.output_tokens > 1 and r.last_token_ms is not None:
                    itl.append((r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1))
        serving = self._serving(sim)
        ready = sum(1 for wid in serving if sim.workers[wid].ready_ms <= now_ms)
        self._ready_samples.append(ready)
        return LiveSignals(
            now_ms=int(now_ms), window_s=self.config.reactive_window_s, arrivals=len(recent),
            step_window_s=self.config.reactive_step_window_s or None, step_arrivals=int(hi - mid),
            mean_isl=_mean([r.isl for r in recent]), mean_osl=_mean([r.osl for r in recent]),
            waiting_requests=waiting, waiting_prefill_tokens=tokens, oldest_wait_ms=oldest,
            p99_ttft_ms=_quantiles(ttft)[1], p99_itl_ms=_quantiles(itl)[1], finished_requests=len(ttft),
            current_replicas={self.role: len(serving)}, ready_replicas={self.role: ready},
            last_scale_up_ms=int(self.reactive_ms[-1]) if self.reactive_ms else None,
            startup_s=self.measured_startup_s(sim, now_ms),
            ttft_over_target=sum(t > self.config.ttft_ms for t in ttft),
            itl_over_target=sum(i > self.config.itl_ms for i in itl))

    def _fast_check(self, now_ms: float, sim: Simulation) -> None:
        state, effects = on_signals(self.state, self.signals(now_ms, sim))
        self.state = state
        if effects is None:
            return
        self.reactive_ms.append(now_ms)
        self._apply(sim, self._serving(sim), effects.decisions[0].target_replicas, now_ms)

    def _interval_tick(self, now_ms: float, sim: Simulation) -> None:
        """Observe the interval just ended, run the core, start or drain workers."""
        t0, t1 = self._window_start_ms, now_ms
        agg = interval_aggregates_from_records(self._window(sim, t1), t0, t1)
        serving = self._serving(sim)
        ready = sum(1 for wid in serving if sim.workers[wid].ready_ms <= now_ms)
        samples = [*self._ready_samples, ready]  # mean over the interval: what actually served it
        self._ready_samples = []
        ready = sum(samples) / len(samples)
        self.state, effects = on_tick(self.state, TickInput(
            now_ms=int(now_ms), traffic=agg.to_observation(), current_replicas={self.role: len(serving)},
            serving_replicas={self.role: ready}, startup_s=self.measured_startup_s(sim, now_ms),
            waiting_requests=len(sim.core.queue) if sim.core.queue is not None else 0))
        decision = effects.decisions[0]
        self._apply(sim, serving, decision.target_replicas, now_ms)
        self._window_start_ms = t1
        hit = (agg.mean_cached_tokens / agg.mean_isl
               if agg.mean_cached_tokens is not None and agg.mean_isl else None)
        self.ticks.append(PlannerTickPoint(
            t_s=now_ms / 1000.0, num_requests=agg.num_requests, observed_rate_per_s=agg.request_rate_per_s,
            predicted_rate_per_s=effects.prediction.request_rate_per_s, mean_isl=agg.mean_isl,
            mean_osl=agg.mean_osl, mean_ttft_ms=agg.mean_ttft_ms, mean_itl_ms=agg.mean_itl_ms, kv_hit_rate=hit,
            serving_replicas=len(serving), needed_replicas=decision.needed_replicas,
            target_replicas=decision.target_replicas, prefill_correction=effects.prefill_correction,
            decode_correction=effects.decode_correction))


def worker_lifetimes(records: Iterable[RequestRecord], worker_ids: Sequence[str], end_ms: float,
                     started_ms: Mapping[str, float] | None = None,
                     drained_ms: Mapping[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """Live interval ``(start, end)`` of every worker, simulated ms.

    A worker starts at ``started_ms[id]`` (0 if absent: the initial pool). It
    ends at ``end_ms``, or, if drained, at the later of its drain time and the
    last finish of a request routed to it (it holds no work after that).
    """
    started_ms, drained_ms = started_ms or {}, drained_ms or {}
    last_finish: dict[str, float] = {}
    for r in records:
        if r.worker_id and r.finish_ms is not None:
            last_finish[r.worker_id] = max(last_finish.get(r.worker_id, 0.0), r.finish_ms)
    out = {}
    for w in worker_ids:
        start = started_ms.get(w, 0.0)
        end = max(drained_ms[w], last_finish.get(w, 0.0)) if w in drained_ms else end_ms
        out[w] = (start, max(start, end))
    return out


def replica_hours(lifetimes: Mapping[str, tuple[float, float]]) -> float:
    """Sum of live time over workers (``(start, end)`` in ms), in hours."""
    return sum(end - start for start, end in lifetimes.values()) / _MS_PER_HOUR


def replica_steps(lifetimes: Mapping[str, tuple[float, float]],
                  drained_ms: Mapping[str, float] | None = None) -> list[ReplicaStep]:
    """Serving and live worker counts as a step function of time (one step per
    change; counts hold until the next step). A worker serves from its start
    until it is drained (or ends) and is live until it ends."""
    drained_ms = drained_ms or {}
    deltas: dict[float, list[int]] = {}
    for w, (start, end) in lifetimes.items():
        stop_serving = min(drained_ms.get(w, end), end)
        for t, d_serving, d_live in ((start, 1, 1), (stop_serving, -1, 0), (end, 0, -1)):
            acc = deltas.setdefault(t, [0, 0])
            acc[0] += d_serving
            acc[1] += d_live
    steps, serving, live = [], 0, 0
    for t in sorted(deltas):
        serving += deltas[t][0]
        live += deltas[t][1]
        steps.append(ReplicaStep(t_s=t / 1000.0, serving=serving, live=live))
    return steps


@dataclass
class PlannerRun:
    """One simulation with the SLA planner: the simulator's result, the hook
    (ticks, starts, drains), worker lifetimes and replica-hours."""

    result: SimResult
    hook: SlaPlannerHook
    lifetimes: dict[str, tuple[float, float]]
    replica_hours: float
    sla_attainment: float

    @property
    def mean_replicas(self) -> float:
        """Time-weighted mean of live workers over ``[0, end_ms]``."""
        return self.replica_hours * _MS_PER_HOUR / self.result.end_ms if self.result.end_ms > 0 else 0.0

    @property
    def max_replicas(self) -> int:
        """Most workers live at once."""
        return max((s.live for s in replica_steps(self.lifetimes)), default=0)


def warm_start_replicas(trace: Trace, config: PlannerConfig, perf: PerfSource) -> int:
    """The pool a planner already running when ``trace`` begins would hold.

    A trace is a slice of traffic that was arriving before it: a deployment
    whose planner ran then holds a pool sized for that load, not its
    minimum. This sizes the pool as the planner core sizes a forecast
    (:func:`~kvflow.planner.core.pool_needs`, corrections 1, no cached
    prompt tokens) for the rate, mean ISL and mean OSL of the requests that
    arrive in the first ``config.adjustment_interval_s`` seconds, rounded
    up and kept within the pool's minimum and ``config.max_gpus`` replicas.

    Raises:
        ValueError: ``config`` is not in aggregated mode, or the profile has no
            feasible point at the first interval's lengths.
    """
    if config.mode is not PlannerMode.aggregated:
        raise ValueError("warm_start_replicas sizes the aggregated pool; use PlannerConfig(mode='aggregated')")
    interval_ms = config.adjustment_interval_s * 1000.0
    first = [r for r in trace.requests if r.arrival_ms < interval_ms]
    lo = config.min_replicas(WorkerRole.aggregated)
    if not first:
        return lo
    pred = Prediction(request_rate_per_s=len(first) / config.adjustment_interval_s,
                      isl=float(np.mean([r.isl for r in first])), osl=float(np.mean([r.osl for r in first])),
                      kv_hit_rate=0.0)
    need, _ = pool_needs(initial_state(config, perf), pred)[WorkerRole.aggregated]
    return min(config.max_gpus, max(lo, math.ceil(need - 1e-9)))


def run_with_planner(trace: Trace, sim_config: SimConfig, planner_config: PlannerConfig, perf: PerfSource, *,
                     sla_ttft_ms: float | None = None, sla_itl_ms: float | None = None,
                     progress: bool = False, fast_interval_s: float | None = 1.0) -> PlannerRun:
    """Simulate ``trace`` with the SLA planner; ``sim_config.workers`` is the
    starting pool. SLA attainment is judged at ``sla_ttft_ms``/``sla_itl_ms``
    (default: the planner's own targets). ``fast_interval_s``: seconds between
    fast-path checks (None: interval ticks only).

    Raises:
        ValueError: planner not in aggregated mode, or as :class:`Simulation`.
    """
    hook = SlaPlannerHook(planner_config, perf, fast_interval_s=fast_interval_s)
    res = Simulation(trace, sim_config, planner=hook, progress=progress).run()
    life = worker_lifetimes(res.records, res.worker_ids, res.end_ms, hook.started_ms, hook.drained_ms)
    ttft = planner_config.ttft_ms if sla_ttft_ms is None else sla_ttft_ms
    itl = planner_config.itl_ms if sla_itl_ms is None else sla_itl_ms
    return PlannerRun(res, hook, life, replica_hours(life), sla_attainment(res.records, ttft, itl))


def run_static(trace: Trace, sim_config: SimConfig, replicas: int, sla_ttft_ms: float,
               sla_itl_ms: float) -> tuple[StaticRun, SimResult]:
    """Simulate ``trace`` on a fixed pool of ``replicas`` workers.

    Raises:
        ValueError: ``replicas < 1``.
    """
    res = Simulation(trace, replace(sim_config, workers=replicas)).run()
    hours = replica_hours(worker_lifetimes(res.records, res.worker_ids, res.end_ms))
    return StaticRun(replicas=replicas, sla_attainment=sla_attainment(res.records, sla_ttft_ms, sla_itl_ms),
                     replica_hours=hours), res


def smallest_static_pool(trace: Trace, sim_config: SimConfig, sla_ttft_ms: float, sla_itl_ms: float,
                         sla_target: float, max_replicas: int, *, hint: int | None = None,
                         runs: dict[int, StaticRun] | None = None) -> tuple[int, bool, dict[int, StaticRun]]:
    """Smallest static pool in ``[1, max_replicas]`` with SLA attainment >= ``sla_target``.

    Bisection, assuming attainment does not fall as the pool grows. ``hint``
    (e.g. the planner's peak) is tried first to narrow the range; ``runs``
    caches earlier results by pool size and is filled in.

    Returns:
        (pool size, whether it meets the target, every run by pool size). When
        no size meets the target the size is ``max_replicas``.
    """
    runs = {} if runs is None else runs

    def ok(n: int) -> bool:
        if n not in runs:
            runs[n] = run_static(trace, sim_config, n, sla_ttft_ms, sla_itl_ms)[0]
        return runs[n].sla_attainment >= sla_target

    lo, hi = 1, max_replicas  # answer in [lo, hi] if hi meets the target
    if hint is not None and 1 <= hint <= max_replicas:
        if ok(hint):
            hi = hint
        else:
            lo = hint + 1
    if lo > hi or not ok(hi):
        return max_replicas, False, runs
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi, True, runs


PROFILE_KINDS = ("phases", "aggregated", "family")
"""``phases``: :func:`kvflow.planner.profile.run_profile` (prefill alone, decode
alone); ``aggregated``: :func:`aggregated_mocker_profile` (both at once, closed loop)
at one mean OSL; ``family``: :func:`aggregated_mocker_profiles` at each OSL of
:data:`PROFILE_OSLS`, which the planner blends around the OSL it observes
(:class:`~kvflow.planner.interpolation.PerfFamily`)."""


def profile_for(mocker: MockerConfig, kind: str = "phases", *, osl: float = 256.0) -> Profile | list[Profile]:
    """Profile the mocker with the simulator's own engine settings (capacity,
    step-time coefficients, ``speedup_ratio``), so the planner sizes the
    replicas it actually gets.

    Args:
        mocker: the simulated workers' engine settings.
        kind: one of :data:`PROFILE_KINDS`.
        osl: ``aggregated`` only: mean output tokens of the profiled requests.

    Returns:
        One profile, or for ``family`` one per OSL of :data:`PROFILE_OSLS`.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "phases":
        return run_profile("mocker", config=mocker)
    if kind == "aggregated":
        return aggregated_mocker_profile(mocker, osl=osl)
    if kind == "family":
        return aggregated_mocker_profiles(mocker)
    raise ValueError(f"unknown profile kind {kind!r}; choose one of {PROFILE_KINDS}")


_GOLDEN = 0.6180339887498949  # Weyl sequence: evenly spread output lengths without a random generator


def closed_loop_point(config: MockerConfig, isl: int, osl: float, concurrency: int,
                      rounds: int) -> tuple[float, float, float, float]:
    """One aggregated operating point of a mocker replica (:func:`closed_loop_stats`):
    (mean TTFT ms, mean ITL ms, prompt tokens/s, output tokens/s).

    Raises:
        ValueError: as :func:`closed_loop_stats`.
    """
    return closed_loop_stats(config, isl, osl, concurrency, rounds)[:4]


def closed_loop_stats(config: MockerConfig, isl: int, osl: float, concurrency: int,
                      rounds: int) -> tuple[float, float, float, float, float, float]:
    """One aggregated operating point of a mocker replica, measured closed loop.

    ``concurrency`` clients each send ``rounds`` requests back to back to a
    fresh :class:`MockerCore` on a simulated clock; prompts are ``isl``
    tokens, output lengths are spread evenly over ``[osl/2, 3*osl/2)`` (mean
    ``osl``) so that clients fall out of step as live traffic does. Prefill
    and decode share the engine's steps, as in an aggregated worker.

    Prefix caching is switched off. Measured over the steady window, from when every client has finished its
    first request to when the first client finishes its last: mean TTFT and
    mean per-request ITL of requests sent in the window, and prompt and
    output tokens per second computed in it.

    Returns:
        (mean TTFT ms, mean ITL ms, prompt tokens/s, output tokens/s, p99 TTFT ms,
        p99 of the requests' mean ITL ms); percentiles are numpy's default (linear).

    Raises:
        ValueError: no request was sent and finished inside the window (raise ``rounds``).
    """
    core = MockerCore(replace(config, enable_prefix_caching=False), worker_id="profile")
    prompt = [1] * isl  # every prompt token is computed: caching is off
    sent: dict[str, tuple[int, float, int]] = {}  # request id -> (client, submit ms, output tokens)
    first_ms: dict[str, float] = {}
    done = [0] * concurrency

    def submit(client: int, now: float) -> None:
        i = len(sent)
        out = max(2, round(osl * (0.5 + (i * _GOLDEN) % 1.0)))
        core.add_request(GenerateRequest(f"c{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True)))
        sent[f"c{i}"] = (client, now, out)

    for c in range(concurrency):
        submit(c, 0.0)
    now, t_a, t_b = 0.0, None, None
    ttft, itl, prompt_tokens, output_tokens = [], [], 0, 0
    while core.has_work():
        step = core.step()
        now += step.duration_ms
        steady = t_a is not None and t_b is None
        if steady:
            prompt_tokens += step.prefill_tokens
            output_tokens += len(step.outputs)
        for rid, out in step.outputs.items():
            first_ms.setdefault(rid, now)
            if out.finish_reason is None:
                continue
            client, t0, n_out = sent[rid]
            if steady and t0 >= t_a:
                ttft.append(first_ms[rid] - t0)
                itl.append((now - first_ms[rid]) / (n_out - 1))
            done[client] += 1
            if done[client] < rounds:
                submit(client, now)
            elif t_b is None:
                t_b = now
        if t_a is None and min(done) >= 1:
            t_a = now
    if not ttft or t_a is None or t_b is None or t_b <= t_a:
        raise ValueError(f"no steady window at isl={isl}, concurrency={concurrency}; raise rounds")
    span_s = (t_b - t_a) / 1000.0
    return (float(np.mean(ttft)), float(np.mean(itl)), prompt_tokens / span_s, output_tokens / span_s,
            float(np.percentile(ttft, 99)), float(np.percentile(itl, 99)))


def aggregated_mocker_profile(config: MockerConfig, *, osl: float = 256.0,
                              isls: Sequence[int] = (128, 256, 512, 1024, 2048, 4096, 8192),
                              concurrencies: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                              min_requests: int = 64) -> Profile:
    """A :class:`Profile` of an aggregated mocker replica: prefill and decode measured together.

    :func:`kvflow.planner.profile.run_profile` measures prefill alone and
    decode alone; an aggregated replica interleaves both, so its ITL includes
    the prefill chunks other requests add to each step, and it cannot give its
    full prefill and decode throughput at once. Here every grid point is a
    closed-loop run (:func:`closed_loop_point`) at (ISL, concurrency) with
    mean output length ``osl``: the prefill grid holds its TTFT and prompt
    tokens/s at ``isl``; the decode grid holds its ITL and output tokens/s at
    context length ``isl + osl/2`` (where the planner core looks them up). A
    replica's prompt and output throughputs then describe the same share of
    its time, so the core's ``aggregated_sizing="max"`` is the right reading.

    Each point also records the requests' p99 TTFT and p99 mean ITL
    (``ttft_p99_ms`` / ``itl_p99_ms``), which a planner targeting the p99 sizes by
    (:meth:`~kvflow.planner.interpolation.PerfModel.from_profile`).

    Prefix caching is off (every prompt token computed). Points that cannot
    run (a sequence larger than the KV pool, or more clients than
    ``max_num_seqs``) are ``None``. ``kv_usage`` is not measured (``None``).

    Args:
        config: engine settings (as the simulated workers use).
        osl: mean output tokens per request (the workload's, e.g. a trace's mean).
        isls: ascending prompt lengths, tokens.
        concurrencies: ascending client counts.
        min_requests: requests per point at least (clients x rounds, >= 8 rounds).

    Raises:
        ValueError: axes not positive and increasing, or ``osl < 2``.
    """
    if osl < 2:
        raise ValueError(f"osl must be >= 2, got {osl}")
    if any(v <= 0 for v in [*isls, *concurrencies]) or list(isls) != sorted(set(isls)) or \
            list(concurrencies) != sorted(set(concurrencies)):
        raise ValueError("isls and concurrencies must be positive and strictly increasing")
    cfg = replace(config, enable_prefix_caching=False)
    grid: list[list[tuple[float, ...] | None]] = []
    for isl in isls:
        row = []
        for c in concurrencies:
            fits = c <= cfg.max_num_seqs and -(-(isl + int(1.5 * osl)) // cfg.block_size) <= cfg.num_kv_blocks
            row.append(closed_loop_stats(cfg, isl, osl, c, max(8, -(-min_requests // c))) if fits else None)
        grid.append(row)

    def column(k: int) -> list[list[float | None]]:
        return [[None if cell is None else cell[k] for cell in row] for row in grid]

    half = round(osl / 2)
    return Profile(
        engine="mocker", model="mocker-aggregated",
        engine_config=json.loads(json.dumps(asdict(cfg))) | {"profile": "aggregated", "osl": osl},
        prefill=PrefillProfile(isl=list(isls), concurrency=list(concurrencies), ttft_ms=column(0),
                               throughput_tokens_per_s=column(2), ttft_p99_ms=column(4)),
        decode=DecodeProfile(context_length=[isl + half for isl in isls], concurrency=list(concurrencies),
                             itl_ms=column(1), throughput_tokens_per_s=column(3),
                             kv_usage=[[None] * len(concurrencies) for _ in isls], itl_p99_ms=column(5)),
    )


PROFILE_OSLS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
"""Mean output lengths :func:`aggregated_mocker_profiles` profiles at, tokens: from
completion-like to long answers, doubling (a :class:`~kvflow.planner.interpolation.PerfFamily`
blends neighbours in log OSL)."""


def aggregated_mocker_profiles(config: MockerConfig, *, osls: Sequence[int] = PROFILE_OSLS,
                               **kwargs: Any) -> list[Profile]:
    """One :func:`aggregated_mocker_profile` per mean OSL in ``osls`` (same ISL and
    concurrency axes), for a :class:`~kvflow.planner.interpolation.PerfFamily`
    (``PerfFamily.from_profiles``) that sizes by the traffic's observed OSL
    instead of one fixed OSL. ``kwargs`` go to each profile.

    Raises:
        ValueError: as :func:`aggregated_mocker_profile`.
    """
    return [aggregated_mocker_profile(config, osl=float(o), **kwargs) for o in osls]


@dataclass
class PlannerEvaluation:
    """A planner run and its static baselines (see the module docstring)."""

    planner: PlannerRun
    summary: PlannerSummary
    static_peak: StaticRun
    static_mean: StaticRun
    static_runs: dict[int, StaticRun] = field(default_factory=dict)


def evaluate_planner(trace: Trace, sim_config: SimConfig, planner_config: PlannerConfig, *,
                     max_replicas: int, sla_ttft_ms: float | None = None, sla_itl_ms: float | None = None,
                     sla_target: float = 0.99, profile: Profile | Sequence[Profile] | None = None,
                     profile_kind: str = "aggregated",
                     progress: bool = False, fast_interval_s: float | None = 1.0) -> PlannerEvaluation:
    """Run ``trace`` with the SLA planner, then on the static-peak and static-mean pools.

    Args:
        trace: the requests.
        sim_config: simulator settings; ``workers`` is the planner's starting pool.
        planner_config: aggregated-mode planner settings.
        max_replicas: upper end of the static-peak search (the planner's cap).
        sla_ttft_ms, sla_itl_ms: the SLA every run is judged by (TTFT and
            per-request mean ITL, ms); default: the planner's targets. A
            planner steering mean latencies needs targets below the SLA
            thresholds for tail headroom; one steering the p99
            (``itl_statistic="p99"``) can take the thresholds as they are.
        sla_target: attainment the static-peak pool must reach, in (0, 1].
        profile: the planner's profile; several profiles at different mean
            OSLs (:func:`aggregated_mocker_profiles`) make a
            :class:`~kvflow.planner.interpolation.PerfFamily` that sizes by the
            observed OSL; default: :func:`profile_for` the simulator's mocker
            as ``profile_kind`` (the aggregated kind with the trace's mean OSL;
            the family kind at :data:`PROFILE_OSLS`).
        profile_kind: one of :data:`PROFILE_KINDS`; recorded in the summary's
            settings (``"given"`` when ``profile`` is passed).
        progress: progress bar for the planner run.
        fast_interval_s: seconds between the planner's fast-path checks (None: none).

    Raises:
        ValueError: ``sla_target`` outside (0, 1], ``max_replicas < 1``, an
            unknown ``profile_kind``, or the planner is not in aggregated mode.
    """
    if not 0 < sla_target <= 1:
        raise ValueError(f"sla_target must be in (0, 1], got {sla_target}")
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
    mocker = replace(sim_config.mocker or MockerConfig(), seed=sim_config.seed)
    mean_osl = float(np.mean([r.osl for r in trace.requests])) if trace.requests else 256.0
    if profile is None:
        profile = profile_for(mocker, profile_kind, osl=max(2.0, mean_osl))
    else:
        profile_kind = "given"
    stats = {"ttft_statistic": planner_config.ttft_statistic, "itl_statistic": planner_config.itl_statistic}
    if isinstance(profile, Profile):
        perf: PerfSource = PerfModel.from_profile(profile, **stats)
        profile_osl = profile.engine_config.get("osl")
    else:
        perf = PerfFamily.from_profiles(profile, **stats)
        profile_osl = [p.engine_config.get("osl") for p in profile]
    ttft = planner_config.ttft_ms if sla_ttft_ms is None else sla_ttft_ms
    itl = planner_config.itl_ms if sla_itl_ms is None else sla_itl_ms
    run = run_with_planner(trace, sim_config, planner_config, perf, sla_ttft_ms=ttft, sla_itl_ms=itl,
                           progress=progress, fast_interval_s=fast_interval_s)
    runs: dict[int, StaticRun] = {}
    peak_n, peak_ok, runs = smallest_static_pool(trace, sim_config, ttft, itl, sla_target, max_replicas,
                                                 hint=min(run.max_replicas, max_replicas), runs=runs)
    mean_n = max(1, math.ceil(run.mean_replicas - 1e-9))
    if mean_n not in runs:
        runs[mean_n] = run_static(trace, sim_config, mean_n, ttft, itl)[0]
    peak, mean = runs[peak_n], runs[mean_n]
    settings = {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(planner_config).items()}
    settings |= {"predictor_kwargs": dict(planner_config.predictor_kwargs), "initial_replicas": sim_config.workers,
                 "profile": profile_kind, "profile_osl": profile_osl,
                 "speedup_ratio": mocker.speedup_ratio, "worker_startup_ms": sim_config.worker_startup_ms}
    summary = PlannerSummary(
        settings=settings, sla_target=sla_target, ticks=run.hook.ticks,
        replicas=replica_steps(run.lifetimes, run.hook.drained_ms), max_replicas=max_replicas,
        planner_max_replicas=run.max_replicas, planner_mean_replicas=run.mean_replicas,
        static_peak_replicas=peak_n, static_peak_meets_target=peak_ok, static_mean_replicas=mean_n,
        static_runs=[runs[n] for n in sorted(runs)],
        replica_hours_vs_static_peak=run.replica_hours / peak.replica_hours if peak.replica_hours else 0.0)
    return PlannerEvaluation(run, summary, peak, mean, runs)
