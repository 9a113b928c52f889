"""The planner's fast reactive path, between interval ticks. This module does zero I/O.

The interval path (:func:`kvflow.planner.core.on_tick`) sizes from requests
that *finished* in the last interval: a burst shows there one interval late,
and a new replica then takes its start-up time on top. The fast path runs
every few seconds on seconds-fresh signals (:class:`LiveSignals`) and only
ever scales **up**:

1. **Demand.** The arrival rate and mean ISL/OSL of the last
   ``reactive_window_s`` seconds, sized exactly as the interval path sizes
   its forecast (:func:`~kvflow.planner.core.pool_needs`, with the current
   correction factors). The rate is the higher of the whole window's and
   a lower bound of that of its last ``reactive_step_window_s`` seconds
   (:func:`step_rate_lower_bound`): right after a step the whole window
   still averages in the seconds before it, and the pool would climb to the
   new rate in several checks instead of one; the bound keeps the Poisson
   noise of a few seconds' count from scaling up.
2. **Pressure.** Any of: a request has waited longer than the TTFT target
   without its first token; the waiting prefill tokens exceed what the
   serving replicas compute within one TTFT target at the profile's peak
   prefill throughput; the window's p99 TTFT or p99 ITL is above target
   (only from windows of at least :data:`MIN_TAIL_REQUESTS` finished
   requests: over fewer, the p99 is nearly the maximum, and one slow
   request would add a replica); or, in a window of any size, more of its
   finished requests exceed a target than a pool meeting its p99 would
   produce (:func:`tail_excess`, when the counts are given): at a few
   requests/s a 5 s window holds fewer than 50, and the first minute of a
   pool sized too small went unseen.
3. **Decide.** Scale up to the demand need when it exceeds the current
   target and there is pressure, or when it reaches ``reactive_jump`` times
   the target (a step in arrivals shows before any queue builds).
   With pressure but no demand excess (longer prompts than the profile
   assumed, a slow replica), add replicas, only while none is starting
   and at most once per start-up time plus one window (the last replica
   added must have served for a window before its effect can show: a
   backlog built while it started does not by itself call for another).
   Under pressure the window's demand is sized with the correction factors
   its own finished requests give (the interval path's formula on the
   window's p99 TTFT/ITL, :func:`~kvflow.planner.core.window_corrections`,
   where above the state's), growing beyond the uncorrected need by at
   most ``max_scale_up_factor`` as the interval path does; at least one
   replica is added. Before the first interval has corrected anything (a
   cold start, a new traffic mix) a pool then grows to the size its
   observed latency calls for, not one replica per start-up time.
   **Cold start**: a pool scaled to zero (``min_*_replicas = 0``) that
   serves whole requests (aggregated, or decode in disaggregated mode)
   starts at least one replica as soon as any request waits
   (``waiting_requests``: the router holds requests for a model no worker
   serves, ``ShedConfig.cold_start_hold_ms``), without waiting for the
   TTFT target to pass.

Scaling down stays with the interval path: its hold
(``scale_down_hold_intervals``) restarts whenever the fast path scales up,
and drained replicas finish their requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvflow.planner.core import (
    PlannerEffects,
    PlannerState,
    PoolDecision,
    Prediction,
    TrafficObservation,
    fit_budget,
    window_corrections,
)
from kvflow.planner.core import pool_needs as _pool_needs
from kvflow.schemas.workers import WorkerRole

__all__ = ["LiveSignals", "on_signals", "MIN_TAIL_REQUESTS", "STEP_Z", "step_rate_lower_bound", "binomial_tail",
           "tail_excess", "TAIL_SHARE", "TAIL_ALPHA"]

MIN_TAIL_REQUESTS = 50
"""Finished requests a window needs before its p99 TTFT/ITL count as pressure."""


@dataclass(frozen=True)
class LiveSignals:
    """Seconds-fresh load signals (one fast-path check).

    Attributes:
        now_ms: epoch (or simulated) ms.
        window_s: the window the arrival figures cover, s.
        arrivals: requests that arrived in the window.
        step_window_s / step_arrivals: the window's last seconds and the
            requests that arrived in them (``step_window_s`` None: not
            measured; only the whole window counts).
        mean_isl / mean_osl: their mean prompt / requested output tokens
            (None without arrivals).
        waiting_requests: requests accepted and not yet in an engine step
            (router queue, including requests held for a cold start, plus
            engines' waiting queues).
        waiting_prefill_tokens: prompt tokens accepted and not yet computed.
        oldest_wait_ms: age of the oldest request still without its first token, ms.
        p99_ttft_ms / p99_itl_ms: of requests finished in the window (None: none finished).
        finished_requests: requests finished in the window.
        current_replicas: replicas per pool, including starting ones.
        ready_replicas: replicas per pool that serve now.
        last_scale_up_ms: when the fast path last scaled up (None: never),
            so a pressure-only step waits for its replica to start and serve.
        startup_s: measured start-up time (None: the configured one).
        ttft_over_target / itl_over_target: of the requests finished in the
            window, how many had a TTFT / per-request mean ITL above the
            planner's target (None: not counted; the p99 rule applies, see
            :func:`tail_excess`).
    """

    now_ms: int
    window_s: float
    arrivals: int
    step_window_s: float | None = None
    step_arrivals: int = 0
    mean_isl: float | None = None
    mean_osl: float | None = None
    waiting_requests: int = 0
    waiting_prefill_tokens: int = 0
    oldest_wait_ms: float = 0.0
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    finished_requests: int = 0
    current_replicas: Mapping[WorkerRole, int] = field(default_factory=dict)
    ready_replicas: Mapping[WorkerRole, int] = field(default_factory=dict)
    last_scale_up_ms: int | None = None
    startup_s: float | None = None
    ttft_over_target: int | None = None
    itl_over_target: int | None = None


_SERVING_ROLES = (WorkerRole.aggregated, WorkerRole.decode)  # pools a request cannot be served without

STEP_Z = 1.0
"""Standard deviations below a short window's count that :func:`step_rate_lower_bound` takes."""


def step_rate_lower_bound(arrivals: int, window_s: float, z: float = STEP_Z) -> float:
    """A lower bound of the arrival rate (requests/s) behind ``arrivals`` counted over ``window_s`` s.

    Arrivals over a short window are a Poisson count ``k`` of mean ``rate *
    window_s`` and standard deviation about ``sqrt(k)``; ``(k - z sqrt(k)) /
    window_s`` (normal approximation; ``z`` = 1, about the 16% quantile)
    rarely exceeds the true rate, so noise alone seldom looks like a step,
    while a real step of several times the rate shows within the window
    (a step to 32 requests/s counted over 2 s: 64 arrivals, bound 24 requests/s).

    Raises:
        ValueError: ``window_s <= 0``.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return max(0.0, arrivals - z * math.sqrt(arrivals)) / window_s


def binomial_tail(k: int, n: int, p: float) -> float:
    """``P(K >= k)`` for ``K ~ Binomial(n, p)`` (exact sum of the probability mass function).

    Raises:
        ValueError: ``n < 0`` or ``p`` outside [0, 1].
    """
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"need n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    below = sum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(k))
    return max(0.0, 1.0 - below)


TAIL_SHARE = 0.01
"""Share of requests a p99 target lets exceed it."""

TAIL_ALPHA = 0.01
"""Significance of :func:`tail_excess`: how often a pool that meets its p99 target still trips it per check."""


def tail_excess(over: int, finished: int, share: float = TAIL_SHARE, alpha: float = TAIL_ALPHA) -> bool:
    """Whether ``over`` of ``finished`` requests above target is more than a pool meeting a
    p(1 - ``share``) target produces: a one-sided exact binomial test (reject ``miss rate <=
    share`` when ``P(Binomial(finished, share) >= over) < alpha``).

    A p99 over a few requests is nearly their maximum, so one slow request would
    pass for pressure; counting requests over the target and testing the count
    works at any window size: with ``share`` 0.01 and ``alpha`` 0.01, 2 of 10,
    3 of 40, 5 of 100 or 8 of 250 finished requests over the target are pressure.
    Source of the test: the one-sided exact binomial test of a proportion
    (Clopper and Pearson, Biometrika 26(4), 1934, for the exact tail).
    """
    return over > 0 and binomial_tail(over, finished, share) < alpha


def _pressure(state: PlannerState, sig: LiveSignals, pool: WorkerRole) -> str | None:
    """Why the pool is behind now, or None."""
    cfg, perf = state.config, state.perf
    if sig.oldest_wait_ms > cfg.ttft_ms:
        return f"a request waits {sig.oldest_wait_ms:.0f} ms > TTFT target {cfg.ttft_ms:g}"
    n = sig.finished_requests
    if sig.ttft_over_target is not None and tail_excess(sig.ttft_over_target, n):
        return f"{sig.ttft_over_target} of {n} finished requests over TTFT target {cfg.ttft_ms:g} ms"
    if sig.itl_over_target is not None and tail_excess(sig.itl_over_target, n):
        return f"{sig.itl_over_target} of {n} finished requests over ITL target {cfg.itl_ms:g} ms"
    tail = n >= MIN_TAIL_REQUESTS
    if tail and sig.p99_ttft_ms is not None and sig.p99_ttft_ms > cfg.ttft_ms:
        return f"p99 TTFT {sig.p99_ttft_ms:.0f} ms > {cfg.ttft_ms:g}"
    if tail and sig.p99_itl_ms is not None and sig.p99_itl_ms > cfg.itl_ms:
        return f"p99 ITL {sig.p99_itl_ms:.1f} ms > {cfg.itl_ms:g}"
    ready = sig.ready_replicas.get(pool, 0)
    if sig.waiting_prefill_tokens and sig.mean_isl:
        per_replica = perf.at_osl(sig.mean_osl).prefill.max_throughput(max(1.0, sig.mean_isl))  # tokens/s
        budget = per_replica * max(1, ready) * cfg.ttft_ms / 1000.0
        if sig.waiting_prefill_tokens > budget:
            return f"{sig.waiting_prefill_tokens} prompt tokens wait > {budget:.0f} computable within the TTFT target"
    return None


def _pressure_step(state: PlannerState, sig: LiveSignals, pred: Prediction, pool: WorkerRole, target: int,
                   need: int) -> tuple[int, str]:
    """The target of a pressure step: the window's demand sized with the correction factors
    the window's own latencies give (:func:`~kvflow.planner.core.window_corrections`, where
    above the state's), at least one replica more, and beyond the demand's need by at most
    ``max_scale_up_factor`` (as the interval path grows); one replica more without a window
    correction. Returns the target and a note."""
    cfg = state.config
    if not (pred.request_rate_per_s > 0 and sig.mean_isl and sig.mean_osl and sig.finished_requests):
        return target + 1, ""

    window = TrafficObservation(duration_s=sig.window_s, num_requests=sig.finished_requests, mean_isl=sig.mean_isl,
                                mean_osl=sig.mean_osl, p99_ttft_ms=sig.p99_ttft_ms, p99_itl_ms=sig.p99_itl_ms)
    p_win, d_win = window_corrections(state, window, sig.ready_replicas)
    p_corr, d_corr = max(p_win, state.prefill_correction), max(d_win, state.decode_correction)
    if (p_corr, d_corr) == (state.prefill_correction, state.decode_correction):
        return target + 1, ""
    corrected = math.ceil(_pool_needs(state, pred, p_corr, d_corr)[pool][0] - 1e-9)
    f = cfg.max_scale_up_factor
    bound = corrected if f is None else max(need, target + 1, math.ceil(target * f - 1e-9))
    step = max(target + 1, min(corrected, bound))
    return step, f"; {corrected} with the window's corrections {p_corr:.2f}/{d_corr:.2f}"


def on_signals(state: PlannerState, sig: LiveSignals) -> tuple[PlannerState, PlannerEffects | None]:
    """One fast-path check (see the module docstring).

    Returns:
        The new state (targets raised, scale-down runs reset) and the effects
        when some pool scales up; ``(state, None)`` otherwise. ``state`` is
        not mutated.

    Raises:
        ValueError: the profile has no feasible point at the window's lengths.
    """
    cfg = state.config
    if sig.arrivals > 0 and sig.mean_isl and sig.mean_osl and sig.window_s > 0:
        rate = sig.arrivals / sig.window_s
        if sig.step_window_s:
            rate = max(rate, step_rate_lower_bound(sig.step_arrivals, sig.step_window_s))
        pred = Prediction(request_rate_per_s=rate, isl=sig.mean_isl, osl=sig.mean_osl,
                          kv_hit_rate=state.kv_hit_rate)
        needs = _pool_needs(state, pred)
    else:
        pred = Prediction(0.0, sig.mean_isl, sig.mean_osl, state.kv_hit_rate)
        needs = {pool: (0.0, "no recent arrivals") for pool in cfg.pools}
    startup_ms = 1000.0 * (cfg.worker_startup_s if sig.startup_s is None else sig.startup_s)
    raised: dict[WorkerRole, int] = {}
    notes: dict[WorkerRole, str] = {}
    demand_step = False
    for pool in cfg.pools:
        current = int(sig.current_replicas.get(pool, 0))
        target = max(current, state.targets.get(pool, current))
        need = max(cfg.min_replicas(pool), math.ceil(needs[pool][0] - 1e-9))
        why = _pressure(state, sig, pool)
        if target == 0 and sig.waiting_requests > 0 and pool in _SERVING_ROLES:
            raised[pool] = max(1, need)
            notes[pool] = (f"reactive cold start 0 -> {raised[pool]}: {sig.waiting_requests} requests wait "
                           f"with no replica (demand needs {needs[pool][0]:.2f})")
        elif need > target and (why is not None or need >= cfg.reactive_jump * max(1, target)):
            step, how = _pressure_step(state, sig, pred, pool, target, need) if why is not None else (need, "")
            raised[pool] = max(need, step)
            demand_step = True
            notes[pool] = (f"reactive scale up {target} -> {raised[pool]}: {pred.request_rate_per_s:.1f} req/s "
                           f"({sig.arrivals} in {sig.window_s:g} s, {sig.step_arrivals} in the last "
                           f"{sig.step_window_s or 0:g} s) need {needs[pool][0]:.2f}"
                           + (f"; {why}" if why else f" >= {cfg.reactive_jump:g} x {target}")
                           + f"{how} ({needs[pool][1]})")
        elif why is not None and need <= target and sig.ready_replicas.get(pool, 0) >= current and (
                sig.last_scale_up_ms is None or sig.now_ms - sig.last_scale_up_ms >= startup_ms + 1000.0 *
                sig.window_s):
            step, how = _pressure_step(state, sig, pred, pool, target, need)
            raised[pool] = step
            notes[pool] = (f"reactive scale up {target} -> {step}: {why} (demand needs {needs[pool][0]:.2f}"
                           f"{how})")
    if not raised:
        return state, None
    wanted = {pool: raised.get(pool, max(int(sig.current_replicas.get(pool, 0)),
                                         state.targets.get(pool, int(sig.current_replicas.get(pool, 0)))))
              for pool in cfg.pools}
    targets = fit_budget(cfg, wanted)
    decisions = []
    for pool in cfg.pools:
        current = int(sig.current_replicas.get(pool, 0))
        reason = f"{pool.value}: {notes.get(pool, 'hold')}"
        if targets[pool] != wanted[pool]:
            reason += f"; GPU budget {cfg.max_gpus} caps {wanted[pool]} -> {targets[pool]}"
        decisions.append(PoolDecision(pool=pool, current_replicas=current, needed_replicas=wanted[pool],
                                      target_replicas=targets[pool], demand_tokens_per_s=0.0, point=None,
                                      reason=reason))
    if all(not d.changed for d in decisions):
        return state, None
    runs = {pool: () for pool in cfg.pools}
    new_state = replace(state, targets={**state.targets, **targets}, down_runs=runs,
                        demand_scale_up_ms=sig.now_ms if demand_step else state.demand_scale_up_ms)
    effects = PlannerEffects(now_ms=sig.now_ms, next_tick_ms=sig.now_ms + int(sig.window_s * 1000),
                             decisions=tuple(decisions), prediction=pred,
                             prefill_correction=state.prefill_correction, decode_correction=state.decode_correction)
    return new_state, effects
