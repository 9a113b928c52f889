"""The planner loop: every adjustment interval, query → ``on_tick`` → publish.

Each tick (:meth:`PlannerLoop.tick`):

1. Flush the metrics sink (``before_query``), so everything consumed is queryable.
2. Aggregate the window ``[t0_ms, t1_ms)`` of finished requests
   (:func:`~kvflow.planner.queries.interval_aggregates`) on the ClickHouse
   thread. ``t1_ms = now_ms - settle_s``: a request finishing just before the
   tick may still be on its way through Kafka, so the window ends a little in
   the past. Windows are contiguous: each starts where the last one ended,
   so every request lands in exactly one window even when a tick is late or
   failed (the next window is then longer, and the core divides by its real
   duration). The first window is one interval long.
3. Call the pure core, :func:`~kvflow.planner.core.on_tick`, with the
   replicas running now (``current_replicas()``).
4. Publish :func:`~kvflow.planner.core.scaling_commands` (pools whose target
   changed) to the scaling topic, keyed by pool. In shadow mode
   (``shadow=True``) the records carry ``shadow=True``: they say what the
   planner would do, and connectors act on none of them.

The start-up time the core plans with (its lead time) is measured here
(:class:`LeadTimeTracker`): from a published scale-up to the tick at which
the pool's counted replicas first reach its target.

Between ticks, with ``fast_interval_s`` set, the fast reactive path
(:meth:`PlannerLoop.fast_check`, :func:`~kvflow.planner.reactive.on_signals`)
runs every ``fast_interval_s`` on the last ``reactive_window_s`` seconds of
finished requests (their count stands for arrivals, with their mean ISL/OSL,
p99 TTFT/ITL and how many exceeded each target; a second count over the last ``reactive_step_window_s``
seconds sizes a step) and, when ``load_signals`` is given, the workers' waiting
requests and prompt tokens from their heartbeats, and, when
``held_requests`` is given, the requests the router holds (with a pool at
zero, the only sign of demand). It only scales up; its commands go out like
a tick's.

A failed tick (ClickHouse error, no feasible profile point) is logged and
leaves the planner state as it was; the loop keeps ticking.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.aio import cancel_and_wait
from kvflow.planner.core import (
    PlannerConfig,
    PlannerEffects,
    PlannerState,
    TickInput,
    initial_state,
    on_tick,
    scaling_commands,
)
from kvflow.planner.interpolation import perf_source
from kvflow.planner.profile import Profile, run_profile
from kvflow.planner.reactive import LiveSignals, on_signals
from kvflow.planner.queries import IntervalAggregates, interval_aggregates
from kvflow.schemas import ScalingCommand, WorkerRole, encode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import make_producer

__all__ = ["PlannerLoop", "TickReport", "ReplicaCounter", "LoadSignals", "HeldRequests", "LeadTimeTracker",
           "load_profile",
           "publish_command", "workers_topic_counter", "workers_topic_load"]

log = logging.getLogger(__name__)

ReplicaCounter = Callable[[], Mapping[WorkerRole, int] | Awaitable[Mapping[WorkerRole, int]]]
"""Returns (or, if async, resolves to) the replicas running now, per pool (a missing pool counts 0)."""

LoadSignals = Callable[[], Awaitable[tuple[int, int]]]
"""Resolves to (waiting requests, waiting prompt tokens) over the serving workers, from their heartbeats."""

HeldRequests = Callable[[], tuple[int, int]]
"""Returns (requests the router holds, age of the oldest in ms), e.g. an in-process router's
:meth:`~kvflow.router.core.RouterCore.held`: demand that no finished request shows yet (a pool
scaled to zero holds every request until its first worker serves)."""


def workers_topic_load(settings: Settings, catalog: Catalog) -> LoadSignals:
    """A :data:`LoadSignals` summing the serving workers' ``waiting_requests`` and
    ``active_prefill_tokens`` on the workers topic (replayed on every call)."""
    from kvflow.streams.workers import read_workers

    async def load() -> tuple[int, int]:
        serving = (await read_workers(settings, catalog)).serving()
        return sum(w.waiting_requests for w in serving), sum(w.active_prefill_tokens for w in serving)

    return load


def load_profile(path: Path | str | Sequence[Path | str] | None, engine: str = "mocker",
                 **mocker_kwargs) -> Profile | list[Profile]:
    """The profile to plan with: read from ``path``, or measured now for the mocker.

    Several paths (profiles taken at different mean OSLs, e.g. ``kvflow
    profile --osl N``) return the list, which :class:`PlannerLoop` turns into
    an OSL family; one path in a list returns that profile.

    Without a path, :func:`~kvflow.planner.profile.run_profile` sweeps the
    mocker on a simulated clock (well under a second); ``mocker_kwargs``
    become its :class:`~kvflow.workers.engines.mocker_core.MockerConfig`, and
    must match the workers' settings for the profile to describe them.

    Raises:
        FileNotFoundError: no file at ``path``.
        pydantic.ValidationError: the file is not a profile.
        NotImplementedError: no ``path`` and ``engine`` is ``hf`` or ``vllm``:
            timing a real engine takes minutes, so it is never done implicitly
            (``kvflow profile --engine hf|vllm`` writes the file to pass).
    """
    if isinstance(path, (list, tuple)):
        if not path:
            path = None
        else:
            loaded = [Profile.load(p) for p in path]
            return loaded[0] if len(loaded) == 1 else loaded
    if path is not None:
        return Profile.load(path)
    if engine != "mocker":
        raise NotImplementedError(f"no profile given for the {engine!r} engine; only the mocker is profiled "
                                  f"automatically: write one with `kvflow profile --engine {engine}` and pass it")
    from kvflow.workers.engines.mocker_core import MockerConfig

    return run_profile("mocker", config=MockerConfig(**mocker_kwargs))


def workers_topic_counter(settings: Settings, catalog: Catalog) -> ReplicaCounter:
    """A :data:`ReplicaCounter` that counts ``serving`` workers per pool in the
    workers topic (replayed on every call, as ``kvflow status`` does; draining
    and expired workers are not counted)."""
    from kvflow.streams.workers import read_workers

    async def count() -> dict[WorkerRole, int]:
        out: dict[WorkerRole, int] = {}
        for w in (await read_workers(settings, catalog)).serving():
            out[w.role] = out.get(w.role, 0) + 1
        return out

    return count


async def publish_command(producer, catalog: Catalog, command: ScalingCommand) -> None:
    """Produce one scaling command, keyed by its pool, and wait for the broker's ack."""
    await producer.send_and_wait(catalog.scaling.name, encode(command), key=command.pool.value.encode())


@dataclass
class LeadTimeTracker:
    """Measures how long a scale-up takes to serve: from the command's
    ``ts_ms`` to the first replica count (of the counter the planner reads:
    serving workers on the workers topic, or the connector's) at or above its
    target. A newer scale-up of a pool replaces an unfinished one; the
    estimate is the mean of the last ``keep`` samples (None before any).

    A count that is read once per tick bounds the resolution to one
    adjustment interval; a lower bound is fine for a lead time (the core adds
    one interval to it).
    """

    keep: int = 8
    pending: dict[WorkerRole, tuple[int, int]] = field(default_factory=dict)  # pool -> (ts_ms, target)
    samples_s: list[float] = field(default_factory=list)

    def on_command(self, command: ScalingCommand) -> None:
        """Note a published command; only scale-ups start a measurement."""
        if command.target_replicas > command.current_replicas and not command.shadow:
            self.pending[command.pool] = (command.ts_ms, command.target_replicas)
        else:
            self.pending.pop(command.pool, None)

    def on_count(self, counted: Mapping[WorkerRole, int], now_ms: int) -> None:
        """Close the measurements whose pool now runs its target."""
        for pool, (ts, target) in list(self.pending.items()):
            if counted.get(pool, 0) >= target:
                self.samples_s = [*self.samples_s[-self.keep + 1:], max(0.0, (now_ms - ts) / 1000.0)]
                del self.pending[pool]

    @property
    def startup_s(self) -> float | None:
        """Mean measured start-up time, s (None: nothing measured yet)."""
        return sum(self.samples_s) / len(self.samples_s) if self.samples_s else None


@dataclass(frozen=True)
class TickReport:
    """What one tick saw and did: the window's aggregates, the core's effects
    and the commands published (empty when no pool's target changed)."""

    aggregates: IntervalAggregates
    current_replicas: Mapping[WorkerRole, int]
    effects: PlannerEffects
    commands: tuple[ScalingCommand, ...]


class PlannerLoop:
    """The live adapter around :func:`~kvflow.planner.core.on_tick`.

    Args:
        settings: Kafka settings.
        catalog: topic catalog.
        clickhouse: the process's :class:`~kvflow.planner.service.SharedClickHouse`.
        config: planner settings (``adjustment_interval_s`` is the tick period).
        profile: engine profile (see :func:`load_profile`), or several taken at
            different mean OSLs: the planner then sizes with the two around
            the OSL it observes (:class:`~kvflow.planner.interpolation.PerfFamily`).
            Read at ``config``'s latency statistics (p99 grids for a p99 target).
        current_replicas: replicas running now, per pool (a plain or an async function).
        model: plan on this model's requests only (``None``: all requests).
        settle_s: the window ends this many seconds before the tick (Kafka and
            sink delay), s.
        before_query: awaited before each query (the sink's flush).
        clock_ms: epoch-ms clock (injected by tests).
        shadow: publish decisions marked advisory (``ScalingCommand.shadow``);
            nothing acts on them.
        fast_interval_s: seconds between fast-path checks (None: no fast path).
        load_signals: the workers' waiting load for the fast path (None: not used).
        held_requests: the router's held requests for the fast path (None: not
            used); a pool with ``min_*_replicas = 0`` needs it to start again
            from zero (:mod:`kvflow.planner.reactive`, cold start).
    """

    def __init__(self, settings: Settings, catalog: Catalog, clickhouse, config: PlannerConfig,
                 profile: Profile | Sequence[Profile], current_replicas: ReplicaCounter, *,
                 model: str | None = None, settle_s: float = 1.0,
                 before_query: Callable[[], Awaitable[object]] | None = None,
                 clock_ms: Callable[[], int] = now_ms, shadow: bool = False,
                 fast_interval_s: float | None = None, load_signals: LoadSignals | None = None,
                 held_requests: HeldRequests | None = None) -> None:
        if fast_interval_s is not None and fast_interval_s <= 0:
            raise ValueError("fast_interval_s must be > 0 (or None)")
        if settle_s < 0:
            raise ValueError("settle_s must be >= 0")
        self.settings, self.catalog, self.clickhouse = settings, catalog, clickhouse
        self.config = config
        self.state: PlannerState = initial_state(config, perf_source(
            profile, ttft_statistic=config.ttft_statistic, itl_statistic=config.itl_statistic))
        self.current_replicas = current_replicas
        self.model = model
        self.settle_ms = int(settle_s * 1000)
        self.before_query = before_query
        self.clock_ms = clock_ms
        self.shadow = shadow
        self.fast_interval_s = fast_interval_s
        self.load_signals = load_signals
        self.held_requests = held_requests
        self.last_fast_ms: int | None = None
        self.fast_commands = 0
        self.lead_time = LeadTimeTracker()
        self.producer = make_producer(settings)
        self.last_window_end_ms: int | None = None
        self.reports: list[TickReport] = []
        """Recent tick reports, newest last (bounded)."""
        self.failed_ticks = 0
        self._task: asyncio.Task | None = None
        self._fast_task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # a tick and a fast check never interleave their state updates

    @property
    def num_ticks(self) -> int:
        """Successful ticks so far."""
        return self.state.num_ticks

    async def start(self, *, run: bool = True) -> None:
        """Connect the producer; with ``run`` also start ticking in the background."""
        await self.producer.start()
        if run:
            self._task = asyncio.create_task(self.run(), name="planner-loop")
            if self.fast_interval_s is not None:
                self._fast_task = asyncio.create_task(self.run_fast(), name="planner-fast-path")

    async def stop(self) -> None:
        """Stop ticking and close the producer."""
        await cancel_and_wait(self._fast_task)
        await cancel_and_wait(self._task)
        self._task = self._fast_task = None
        await self.producer.stop()

    async def run(self) -> None:
        """Tick every ``adjustment_interval_s`` (first tick one interval after start) until cancelled."""
        interval_s = self.config.adjustment_interval_s
        loop = asyncio.get_running_loop()
        next_s = loop.time() + interval_s
        while True:
            await asyncio.sleep(max(0.0, next_s - loop.time()))
            next_s += interval_s
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed tick must not stop planning
                self.failed_ticks += 1
                log.exception("planner tick failed; state unchanged")
            if loop.time() > next_s:  # a slow tick: skip missed slots rather than burst
                next_s = loop.time() + interval_s

    async def run_fast(self) -> None:
        """Run :meth:`fast_check` every ``fast_interval_s`` until cancelled; failures are logged."""
        while True:
            await asyncio.sleep(self.fast_interval_s)
            try:
                await self.fast_check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed check must not stop the fast path
                log.exception("planner fast check failed; state unchanged")

    async def _counted(self) -> dict[WorkerRole, int]:
        counted = self.current_replicas()
        if inspect.isawaitable(counted):
            counted = await counted
        return {WorkerRole(k): int(v) for k, v in counted.items()}

    async def fast_check(self, now: int | None = None) -> tuple[ScalingCommand, ...]:
        """One fast-path check at epoch-ms ``now`` (see the module docstring); returns the commands published.

        Raises:
            clickhouse_connect.driver.exceptions.DatabaseError: the query failed.
            aiokafka.errors.KafkaError: a command could not be published.
        """
        now = self.clock_ms() if now is None else now
        window_s = self.config.reactive_window_s
        t1 = now - self.settle_ms
        if self.before_query is not None:
            await self.before_query()
        agg = await self.clickhouse.run(interval_aggregates, self.clickhouse.client, t1 - int(window_s * 1000), t1,
                                        model=self.model, ttft_target_ms=self.config.ttft_ms,
                                        itl_target_ms=self.config.itl_ms)
        step_s = self.config.reactive_step_window_s
        step = (await self.clickhouse.run(interval_aggregates, self.clickhouse.client, t1 - int(step_s * 1000), t1,
                                          model=self.model)).num_requests if step_s else 0
        waiting, tokens = (await self.load_signals()) if self.load_signals is not None else (0, 0)
        held, oldest_ms = self.held_requests() if self.held_requests is not None else (0, 0)
        async with self._lock:
            current = await self._counted()
            self.lead_time.on_count(current, now)
            state, effects = on_signals(self.state, LiveSignals(
                now_ms=now, window_s=window_s, arrivals=agg.num_requests, step_window_s=step_s or None,
                step_arrivals=step, mean_isl=agg.mean_isl,
                mean_osl=agg.mean_osl, waiting_requests=waiting + held, waiting_prefill_tokens=tokens,
                oldest_wait_ms=oldest_ms,
                p99_ttft_ms=agg.p99_ttft_ms, p99_itl_ms=agg.p99_itl_ms, finished_requests=agg.num_requests,
                ttft_over_target=agg.ttft_over_target, itl_over_target=agg.itl_over_target,
                current_replicas=current,
                ready_replicas=current, last_scale_up_ms=self.last_fast_ms, startup_s=self.lead_time.startup_s))
            if effects is None:
                return ()
            commands = tuple(scaling_commands(effects, shadow=self.shadow))
            for command in commands:
                await publish_command(self.producer, self.catalog, command)
                self.lead_time.on_command(command)
                log.info("%sreactive scaling %s %d -> %d (%s)", "shadow: " if self.shadow else "",
                         command.pool.value, command.current_replicas, command.target_replicas, command.reason)
            self.state, self.last_fast_ms = state, now
            self.fast_commands += len(commands)
            return commands

    async def tick(self, now: int | None = None) -> TickReport:
        """Run one planning step at epoch-ms ``now`` (default: the clock).

        Returns:
            The tick's report. The state advances and commands are published
            only if every step succeeded.

        Raises:
            ValueError: the profile has no feasible point at the observed lengths.
            clickhouse_connect.driver.exceptions.DatabaseError: the query failed.
            aiokafka.errors.KafkaError: a command could not be published.
        """
        now = self.clock_ms() if now is None else now
        t1 = now - self.settle_ms
        t0 = self.last_window_end_ms if self.last_window_end_ms is not None \
            else t1 - int(self.config.adjustment_interval_s * 1000)
        t0 = min(t0, t1 - 1)  # a clock step backwards must not make an empty window
        if self.before_query is not None:
            await self.before_query()
        agg = await self.clickhouse.run(interval_aggregates, self.clickhouse.client, t0, t1, model=self.model)
        async with self._lock:
            return await self._decide(now, t0, t1, agg)

    async def _decide(self, now: int, t0: int, t1: int, agg: IntervalAggregates) -> TickReport:
        current = await self._counted()
        self.lead_time.on_count(current, now)
        held = self.held_requests()[0] if self.held_requests is not None else 0
        state, effects = on_tick(self.state, TickInput(now_ms=now, traffic=agg.to_observation(),
                                                       current_replicas=current, startup_s=self.lead_time.startup_s,
                                                       waiting_requests=held))
        commands = tuple(scaling_commands(effects, shadow=self.shadow))
        for command in commands:
            await publish_command(self.producer, self.catalog, command)
            self.lead_time.on_command(command)
            log.info("%sscaling %s %d -> %d (%s)", "shadow: " if self.shadow else "", command.pool.value,
                     command.current_replicas, command.target_replicas, command.reason)
        self.state, self.last_window_end_ms = state, t1
        report = TickReport(agg, current, effects, commands)
        self.reports = [*self.reports[-99:], report]
        log.debug("tick %d: window [%d, %d) %d requests, targets %s", state.num_ticks, t0, t1, agg.num_requests,
                  {d.pool.value: d.target_replicas for d in effects.decisions})
        return report
