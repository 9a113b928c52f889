"""The SLA planner sizing each worker pool of an offline replay from that pool's own load.

A deployment split into worker pools (:mod:`kvflow.router.pools`: e.g.
``long-context`` beside ``low-latency``) routes each request within the
pools its grid picks, so each pool sees its own traffic and needs its own
size. :class:`PoolPlannerHook` runs one planner core per pool
(:func:`~kvflow.planner.core.on_tick`, and the fast path
:func:`~kvflow.planner.reactive.on_signals` between ticks), each with its own
:class:`~kvflow.planner.core.PlannerConfig`, state, corrections and
predictors. A pool's config may be aggregated (one target) or
disaggregated (a prefill and a decode target).

What each pool's planner observes:

* **decode (or whole-request) load**: requests the pool's workers decoded
  (``RequestRecord.worker_id``), as :func:`interval_aggregates_from_records`
  computes them; a request that failed before any worker took it counts in
  the decode pool its grid picked;
* **prefill load** (disaggregated pools): requests whose prompt the pool's
  prefill workers computed (``prefill_worker_id``), counted when their
  prefill ended (the first token, after the KV transfer) rather than when
  the request finished, as
  :attr:`~kvflow.planner.core.TickInput.prefill_traffic`; short prompts
  prefilled locally on a decode worker load the decode pool only;
* **fast path**: arrivals of the last ``reactive_window_s`` whose grid
  decode pool is this one, the pool's requests still waiting (held by the
  router, or in its engines' queues) and its recent p99 TTFT/ITL;
* **waiting requests**: requests of the pool nobody took yet (a pool at zero).

Scaling: new workers join their pool (``Simulation.add_worker(role,
pool=...)``) and serve after ``SimConfig.worker_startup_ms``; scaling down
drains the pool's newest serving workers of the role. Every pool's config
must share ``adjustment_interval_s`` (one tick clock) and its mode (the
routing rule decodes on decode workers whenever a model has any, so an
aggregated pool beside a disaggregated one would get nothing).

:func:`run_pool_planner` runs a trace with it and reports per pool
(:class:`PoolPlannerRun`): SLA attainment of the requests the pool decoded,
replica-hours and mean/max workers per role, ticks per pool and role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvflow.planner.core import PlannerConfig, PlannerState, TickInput, initial_state, on_tick
from kvflow.planner.interpolation import PerfFamily, PerfModel, PerfSource
from kvflow.planner.reactive import LiveSignals, on_signals
from kvflow.replay.planner_eval import (
    interval_aggregates_from_records,
    replica_hours,
    replica_steps,
    worker_lifetimes,
)
from kvflow.replay.report import RequestRecord, sla_attainment
from kvflow.replay.simulator import SimConfig, SimResult, Simulation
from kvflow.replay.traces import Trace, TraceRequest
from kvflow.schemas import WorkerRole

__all__ = ["PoolTick", "PoolPlannerHook", "PoolFigures", "PoolPlannerRun", "run_pool_planner"]


def _done_ms(r: RequestRecord) -> float | None:
    if r.finish_ms is not None:
        return r.finish_ms
    return r.arrival_ms if r.error is not None else None


def _p99(values: Sequence[float]) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), 99)) if values else None


@dataclass(frozen=True)
class PoolTick:
    """One interval tick of one pool and role: when (simulated s), the requests
    the pool finished in the interval (decoded, or prefilled for the prefill
    role), the role's serving replicas before the tick, its need and target."""

    t_s: float
    pool: str
    role: WorkerRole
    finished_requests: int
    serving_replicas: int
    needed_replicas: int
    target_replicas: int


class PoolPlannerHook:
    """A :class:`~kvflow.replay.simulator.PlannerHook` running one SLA planner per
    worker pool (module docstring).

    Args:
        configs: pool name (``""``: the default pool) → that pool's planner settings.
        perf: the profile every pool sizes with, or one per pool name.
        fast_interval_s: seconds between fast-path checks; None: interval ticks only.

    Attributes:
        states: pool name → its planner core's state.
        ticks: every interval tick, per pool and role, in order.
        started_ms / drained_ms: worker id → simulated ms the hook started / drained it.
        reactive_ms: pool name → simulated ms of its fast-path scale-ups.

    Raises:
        ValueError: no pool, pools in different modes or with different
            ``adjustment_interval_s``, a missing profile, or ``fast_interval_s <= 0``.
    """

    def __init__(self, configs: Mapping[str, PlannerConfig], perf: PerfSource | Mapping[str, PerfSource], *,
                 fast_interval_s: float | None = 1.0) -> None:
        if not configs:
            raise ValueError("give at least one pool to plan")
        if len({c.mode for c in configs.values()}) != 1:
            # the routing rule decodes on decode workers whenever the model has any: an aggregated
            # pool beside a disaggregated one would get no request
            raise ValueError("every pool must be planned in the same mode (aggregated or disaggregated)")
        intervals = {c.adjustment_interval_s for c in configs.values()}
        if len(intervals) != 1:
            raise ValueError(f"every pool must share one adjustment_interval_s, got {sorted(intervals)}")
        if fast_interval_s is not None and fast_interval_s <= 0:
            raise ValueError("fast_interval_s must be > 0 (or None)")
        perfs = {p: perf for p in configs} if isinstance(perf, (PerfModel, PerfFamily)) else dict(perf)
        missing = set(configs) - set(perfs)
        if missing:
            raise ValueError(f"no profile for pools {sorted(missing)}")
        self.configs = dict(configs)
        self.tick_ms = intervals.pop() * 1000.0
        self.interval_ms = self.tick_ms if fast_interval_s is None else min(self.tick_ms, fast_interval_s * 1000.0)
        self.states: dict[str, PlannerState] = {p: initial_state(c, perfs[p]) for p, c in configs.items()}
        self.ticks: list[PoolTick] = []
        self.started_ms: dict[str, float] = {}
        self.drained_ms: dict[str, float] = {}
        self.reactive_ms: dict[str, list[float]] = {p: [] for p in configs}
        self._next_tick_ms = self.tick_ms
        self._window_start_ms = 0.0
        self._pending: list[RequestRecord] | None = None
        self._unprefilled: list[RequestRecord] = []  # records without a first token yet
        self._arrivals: dict[str, np.ndarray] = {}
        self._requests: dict[str, list[TraceRequest]] = {}
        self._grid_pool: dict[str, str] = {}  # request id -> the decode pool its grid picks

    # ---- the simulation's view, per pool ------------------------------------------

    def _index(self, sim: Simulation) -> None:
        """Group the trace's requests by the decode pool the router's grid picks (once)."""
        if self._pending is not None:
            return
        self._pending = list(sim._records.values())  # read-only: the live records, in arrival order
        self._unprefilled = list(self._pending)
        grid = sim.core.pool_grid
        by_pool: dict[str, list[TraceRequest]] = {p: [] for p in self.configs}
        for r in sim.requests:
            pool = grid.choose(r.isl, r.osl, r.ttft_target_ms, r.itl_target_ms).decode if grid is not None else ""
            self._grid_pool[r.request_id] = pool
            by_pool.setdefault(pool, []).append(r)
        self._requests = by_pool
        self._arrivals = {p: np.fromiter((r.arrival_ms for r in reqs), dtype=np.float64)
                          for p, reqs in by_pool.items()}

    def _pool_of(self, sim: Simulation, r: RequestRecord) -> str:
        """The pool that decoded ``r`` (its grid pick while no worker took it)."""
        return sim.workers[r.worker_id].pool if r.worker_id else self._grid_pool.get(r.request_id, "")

    def _serving(self, sim: Simulation, pool: str, role: WorkerRole) -> list[str]:
        """Serving (not draining) workers of ``pool`` and ``role``, oldest first."""
        return sorted((w.worker_id for w in sim.workers.values()
                       if w.pool == pool and w.role == role and not w.draining), key=lambda wid: (len(wid), wid))

    def _counts(self, sim: Simulation, pool: str, now_ms: float) -> tuple[dict, dict]:
        """(serving, ready) workers of ``pool`` per planned role."""
        current, ready = {}, {}
        for role in self.configs[pool].pools:
            ids = self._serving(sim, pool, role)
            current[role] = len(ids)
            ready[role] = sum(1 for w in ids if sim.workers[w].ready_ms <= now_ms)
        return current, ready

    def _startup_s(self, sim: Simulation, pool: str, now_ms: float) -> float | None:
        seen = [sim.workers[w].ready_ms - t for w, t in self.started_ms.items()
                if sim.workers[w].pool == pool and sim.workers[w].ready_ms <= now_ms]
        return sum(seen) / len(seen) / 1000.0 if seen else None

    def _waiting(self, sim: Simulation, pool: str, now_ms: float) -> tuple[int, float]:
        """Requests of ``pool`` no worker took yet (held by the router), and the oldest wait
        without a first token among the pool's requests, ms."""
        held, oldest = 0, 0.0
        for r in self._pending:
            if r.arrival_ms > now_ms:
                break
            if r.first_token_ms is None and r.error is None and self._pool_of(sim, r) == pool:
                oldest = max(oldest, now_ms - r.arrival_ms)
                held += not r.worker_id
        return held, oldest

    def _apply(self, sim: Simulation, pool: str, role: WorkerRole, target: int, now_ms: float) -> None:
        serving = self._serving(sim, pool, role)
        for _ in range(target - len(serving)):
            self.started_ms[sim.add_worker(role, pool=pool)] = now_ms
        for worker_id in reversed(serving[target:]):  # newest first
            sim.drain_worker(worker_id)
            self.drained_ms[worker_id] = now_ms

    # ---- the hook ------------------------------------------------------------------

    def on_tick(self, now_ms: float, sim: Simulation) -> None:
        """An interval tick of every pool when one is due, else a fast-path check of every pool."""
        self._index(sim)
        if now_ms + 1e-6 >= self._next_tick_ms:
            self._next_tick_ms += self.tick_ms
            self._interval_tick(now_ms, sim)
        else:
            for pool in self.configs:
                self._fast_check(now_ms, sim, pool)

    def _interval_tick(self, now_ms: float, sim: Simulation) -> None:
        t0, t1 = self._window_start_ms, now_ms
        done, pending = [], []
        for r in self._pending:
            d = _done_ms(r)
            (done if d is not None and d < t1 else pending).append(r)
        self._pending = pending
        self._window_start_ms = t1
        prefilled: list[RequestRecord] = []  # remote prefills that ended in the window, as if they finished then
        if any(WorkerRole.prefill in c.pools for c in self.configs.values()):
            waiting = []
            for r in self._unprefilled:
                if r.first_token_ms is not None and r.first_token_ms < t1:
                    if r.prefill_worker_id:
                        prefilled.append(replace(r, finish_ms=r.first_token_ms, last_token_ms=None, output_tokens=1))
                elif r.error is None:
                    waiting.append(r)
            self._unprefilled = waiting
        for pool, cfg in self.configs.items():
            decoded = [r for r in done if self._pool_of(sim, r) == pool]
            traffic = interval_aggregates_from_records(decoded, t0, t1).to_observation()
            prefill = None
            if WorkerRole.prefill in cfg.pools:
                mine = [r for r in prefilled if sim.workers[r.prefill_worker_id].pool == pool]
                prefill = interval_aggregates_from_records(mine, t0, t1).to_observation()
            current, ready = self._counts(sim, pool, now_ms)
            held, _ = self._waiting(sim, pool, now_ms)
            self.states[pool], effects = on_tick(self.states[pool], TickInput(
                now_ms=int(now_ms), traffic=traffic, current_replicas=current, serving_replicas=ready,
                startup_s=self._startup_s(sim, pool, now_ms), waiting_requests=held, prefill_traffic=prefill))
            for d in effects.decisions:
                self.ticks.append(PoolTick(
                    t_s=now_ms / 1000.0, pool=pool, role=d.pool,
                    finished_requests=(prefill.num_requests if d.pool is WorkerRole.prefill and prefill is not None
                                       else traffic.num_requests),
                    serving_replicas=current[d.pool], needed_replicas=d.needed_replicas,
                    target_replicas=d.target_replicas))
                self._apply(sim, pool, d.pool, d.target_replicas, now_ms)

    def _fast_check(self, now_ms: float, sim: Simulation, pool: str) -> None:
        cfg = self.configs[pool]
        window_ms, step_ms = cfg.reactive_window_s * 1000.0, cfg.reactive_step_window_s * 1000.0
        arrivals = self._arrivals.get(pool)
        lo, mid, hi = (np.searchsorted(arrivals, [now_ms - window_ms, now_ms - step_ms, now_ms], side="right")
                       if arrivals is not None else (0, 0, 0))
        recent = self._requests.get(pool, [])[lo:hi]
        held, oldest = self._waiting(sim, pool, now_ms)
        engine_waiting, tokens = 0, 0
        for w in sim.workers.values():
            if w.pool == pool:
                s = w.core.stats(w.pending)
                engine_waiting += s.waiting_requests
                tokens += s.active_prefill_tokens
        ttft, itl = [], []
        for r in self._pending:
            if r.arrival_ms > now_ms:
                break
            if r.finish_ms is not None and r.finish_ms >= now_ms - window_ms and r.first_token_ms is not None \
                    and self._pool_of(sim, r) == pool:
                ttft.append(r.first_token_ms - r.arrival_ms)
                if r.output_tokens > 1 and r.last_token_ms is not None:
                    itl.append((r.last_token_ms - r.first_token_ms) / (r.output_tokens - 1))
        current, ready = self._counts(sim, pool, now_ms)
        last = self.reactive_ms[pool]
        state, effects = on_signals(self.states[pool], LiveSignals(
            now_ms=int(now_ms), window_s=cfg.reactive_window_s, arrivals=len(recent),
            step_window_s=cfg.reactive_step_window_s or None, step_arrivals=int(hi - mid),
            mean_isl=float(np.mean([r.isl for r in recent])) if recent else None,
            mean_osl=float(np.mean([r.osl for r in recent])) if recent else None,
            waiting_requests=held + engine_waiting, waiting_prefill_tokens=tokens, oldest_wait_ms=oldest,
            p99_ttft_ms=_p99(ttft), p99_itl_ms=_p99(itl), finished_requests=len(ttft), current_replicas=current,
            ready_replicas=ready, last_scale_up_ms=int(last[-1]) if last else None,
            startup_s=self._startup_s(sim, pool, now_ms)))
        self.states[pool] = state
        if effects is None:
            return
        last.append(now_ms)
        for d in effects.decisions:
            self._apply(sim, pool, d.pool, d.target_replicas, now_ms)


@dataclass(frozen=True)
class PoolFigures:
    """One pool's outcome in a :class:`PoolPlannerRun`.

    ``requests``: requests the pool decoded (or that its grid picked and that
    failed before any worker took them); ``sla_attainment`` over them;
    per role: ``replica_hours``, time-weighted ``mean_workers`` and
    ``max_workers`` live at once.
    """

    pool: str
    requests: int
    sla_attainment: float
    replica_hours: dict[str, float]
    mean_workers: dict[str, float]
    max_workers: dict[str, int]

    def as_dict(self) -> dict:
        """JSON-able figures, rounded."""
        return {"pool": self.pool, "requests": self.requests, "sla_attainment": round(self.sla_attainment, 4),
                "replica_hours": {k: round(v, 4) for k, v in self.replica_hours.items()},
                "mean_workers": {k: round(v, 2) for k, v in self.mean_workers.items()},
                "max_workers": dict(self.max_workers)}


@dataclass
class PoolPlannerRun:
    """A replay with one planner per pool: the simulator's result, the hook, and per-pool figures."""

    result: SimResult
    hook: PoolPlannerHook
    lifetimes: dict[str, tuple[float, float]]
    pools: dict[str, PoolFigures] = field(default_factory=dict)

    @property
    def replica_hours(self) -> float:
        """Replica-hours of every pool and role together."""
        return replica_hours(self.lifetimes)


def run_pool_planner(trace: Trace | Sequence[TraceRequest], sim_config: SimConfig,
                     configs: Mapping[str, PlannerConfig], perf: PerfSource | Mapping[str, PerfSource], *,
                     initial: Mapping[str, Mapping[WorkerRole, int]], sla_ttft_ms: float, sla_itl_ms: float,
                     fast_interval_s: float | None = 1.0) -> PoolPlannerRun:
    """Simulate ``trace`` with one SLA planner per worker pool.

    Args:
        trace: the requests.
        sim_config: simulator settings; its ``pool_grid`` routes requests to
            pools. Its own start-up workers (``workers``, ``pool_workers``, ...)
            should be 0: ``initial`` gives each pool's.
        configs: pool name → planner settings (module docstring).
        perf: the profile every pool sizes with, or one per pool.
        initial: pool name → role → workers at start (ready at once).
        sla_ttft_ms, sla_itl_ms: the SLA attainment is judged by (ms).
        fast_interval_s: seconds between fast-path checks (None: none).

    Raises:
        ValueError: as :class:`PoolPlannerHook` and :class:`Simulation`, or an
            ``initial`` role the pool's config does not plan.
    """
    hook = PoolPlannerHook(configs, perf, fast_interval_s=fast_interval_s)
    sim = Simulation(trace, sim_config, planner=hook)
    for pool, roles in initial.items():
        for role, count in roles.items():
            if pool not in configs or WorkerRole(role) not in configs[pool].pools:
                raise ValueError(f"pool {pool!r} plans no {WorkerRole(role).value} workers")
            for _ in range(count):
                sim.add_worker(WorkerRole(role), startup_ms=0.0, pool=pool)
    res = sim.run()
    life = worker_lifetimes(res.records, res.worker_ids, res.end_ms, hook.started_ms, hook.drained_ms)
    run = PoolPlannerRun(res, hook, life)
    span_ms = res.end_ms or 1.0
    for pool in configs:
        recs = [r for r in res.records
                if (res.worker_pools.get(r.worker_id, "") if r.worker_id else hook._grid_pool.get(r.request_id, ""))
                == pool]
        hours, mean, peak = {}, {}, {}
        for role in configs[pool].pools:
            mine = {w: span for w, span in life.items()
                    if res.worker_pools.get(w) == pool and res.worker_roles.get(w) == role.value}
            hours[role.value] = replica_hours(mine)
            mean[role.value] = hours[role.value] * 3_600_000.0 / span_ms
            peak[role.value] = max((s.live for s in replica_steps(mine)), default=0)
        run.pools[pool] = PoolFigures(pool, len(recs), sla_attainment(recs, sla_ttft_ms, sla_itl_ms), hours, mean,
                                      peak)
    return run
