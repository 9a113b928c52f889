"""Offline replay: a discrete-event simulation of a kvflow deployment, aggregated or disaggregated.

No broker, no wall clock. Trace arrivals are routed by the live router's
own core, :class:`~kvflow.router.core.RouterCore` (policy, load shedding,
the bounded queue, disaggregation, in-flight accounting), fed a heartbeat
of each simulated worker's load just before every decision and the same
in-flight records a live worker publishes (request taken, ended), to N
:class:`~kvflow.workers.engines.mocker_core.MockerCore` engines, each stepping
on a simulated clock:

* a worker with work starts a step at ``now``; the core computes it at once
  and says how long it takes; its outputs and KV events are delivered at
  ``now + duration_ms``, when the next step starts if work remains;
* requests arriving at a busy worker join its next step; simultaneous
  arrivals at an idle worker are all queued before its step starts;
* events at equal times run arrivals first, then KV transfer ends, then step
  ends, then step starts (so a request that reaches an engine at the instant
  its next step begins joins that step).

Load shedding and the queue (``SimConfig.shed``, the live router's
``shed_*`` settings): a request the core sheds fails with ``shed: ...`` and
counts in ``SimResult.router_counts["shed"]``; a request it queues waits
for the core's tick, which runs every ``SimConfig.router_tick_ms`` of
simulated time while requests are held (the live router ticks every
heartbeat interval), and is routed when the tick releases it (its queueing
shows in TTFT).

A trace request's ``priority``, ``tenant``, ``session_id`` and
``timeout_ms`` reach the core on its :class:`~kvflow.router.core.Arrival`
(the deadline is arrival + ``timeout_ms``; only the router's queue enforces
it here, the simulated engines run a routed request to its end), so the
``priority`` queue order and session affinity replay as they run live.

Timings recorded per request (see :mod:`kvflow.replay.report`): arrival,
first scheduled (start of the first step that admitted it), every token
delivery, finish. The loop is one heap of step events merged with the sorted
arrival list, so it is deterministic for a given trace and seed.

Disaggregated mode (``SimConfig.prefill_workers`` / ``decode_workers`` > 0,
or any worker added with a prefill or decode role): each arrival is placed by
the live router's rule, :func:`kvflow.router.disagg.place` (decode worker by
the policy over the decode pool, else the aggregated pool; remote prefill only
when the uncached prompt exceeds ``DisaggConfig.prefill_threshold_tokens`` and
the prefill pool's queue is short). The worker paths mirror
:mod:`kvflow.workers.disagg` with the mocker engine
(:mod:`kvflow.workers.engines.mocker`):

* local prefill: the decode (or aggregated) worker serves the whole request,
  exactly as an aggregated worker does;
* remote prefill: the prefill worker's core runs the prompt with
  ``max_tokens = 1`` (``MockerEngine.prefill``); at the end of the step that
  samples that token, the KV transfer starts: it moves the prompt tokens the
  decode worker's prefix cache lacks at that moment
  (``MockerCore.cached_prompt_tokens``) and lasts
  :func:`~kvflow.workers.engines.mocker_core.kv_transfer_time_ms` of them,
  divided by ``speedup_ratio`` (``MockerEngine.generate_from_kv``). Transfers
  run concurrently and never contend for bandwidth;
* at the transfer's end the decode worker delivers the prefill's first token
  (so **TTFT = prefill queueing and compute + KV transfer**: the live prefill
  worker sends nothing to the client, the decode worker streams the first
  token after pulling the KV) and, if more tokens are due, adds the request
  to its core with ``kv_imported=True``: blocks allocated and committed, no
  prefill compute; tokens 1, 2, ... come from its steps, so every ITL gap is
  decode-worker time (the first gap includes waiting for a step in flight).

A remote request's ``cached_tokens`` is the prefill worker's prefix hit (as
the live final response reports it); ``worker_id`` is the decode worker,
``prefill_worker_id`` the prefill worker, ``scheduled_ms`` the start of its
first prefill step, ``kv_transfer_ms``/``kv_transfer_tokens`` the modelled
transfer. Until its KV arrives a remote request is on no decode engine, so
its decode worker's heartbeat figures leave it out while it prefills and
transfers, as the live worker's do; the router counts it on the decode worker
from its routing (as a request the heartbeat leaves out, with no prompt
work) until the decode worker takes it at the transfer's end, as the live
router does until the decode worker's admission record (or for at most the
worker's heartbeat TTL, 5 s). With both aggregated and decode workers, the live
rule sends nothing to the aggregated ones; with aggregated and prefill
workers only, the aggregated workers are the decode targets.

Extension points:

* ``kv_hook.on_kv_events(worker_id, events)`` receives each step's KV events
  at the step's end (default, for an event-fed policy: the router core's
  index, :meth:`~kvflow.router.core.RouterCore.on_kv_events`);
* ``planner.on_tick(now_ms, sim)`` is called every ``planner.interval_ms``
  and may call :meth:`Simulation.add_worker` / :meth:`Simulation.drain_worker`;
* :meth:`Simulation.dispatch` hands one arrived request to the router core.
"""

from __future__ import annotations

import heapq
import logging
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

from kvflow.replay.report import RequestRecord, TimelineSample
from kvflow.replay.synth import PrefixHasher
from kvflow.replay.traces import Trace, TraceRequest
from kvflow.router.core import Arrival, Decision, RouterCore
from kvflow.router.disagg import DisaggConfig
from kvflow.router.kv_policy import KvPolicyConfig
from kvflow.router.policies import HASH_FREE_POLICIES
from kvflow.router.pools import PoolGrid
from kvflow.router.shedding import ShedConfig
from kvflow.router.table import RoutingTable
from kvflow.schemas import (
    DecisionOutcome,
    FinishReason,
    KvEvent,
    RequestAdmitted,
    RequestFinished,
    SamplingParams,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.workers.engines.base import EngineError, EngineOutput, GenerateRequest
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore, StepResult, kv_transfer_time_ms

__all__ = [
    "KvEventHook",
    "PlannerHook",
    "SimConfig",
    "SimWorker",
    "SimResult",
    "Simulation",
    "simulate",
]

log = logging.getLogger(__name__)

# Heap tie-break order at equal times (arrivals are merged from the sorted list before all of these).
_ARRIVAL_KIND, _TRANSFER_END, _STEP_END, _STEP_START, _TICK, _READY, _ROUTER_TICK = -1, 0, 1, 2, 3, 4, 5
_DELIVER, _HEARTBEAT = 6, 7  # a record one hop later; a worker's periodic heartbeat (only with ``hop_ms``)
_BACKGROUND = (_TICK, _HEARTBEAT)  # periodic: they do not keep the simulation alive

_ROLE_PREFIX = {WorkerRole.aggregated: "worker", WorkerRole.prefill: "prefill", WorkerRole.decode: "decode"}


class KvEventHook(Protocol):
    """Receives every worker's KV events (a KV index for KV-aware routing)."""

    def on_kv_events(self, worker_id: str, events: list[KvEvent]) -> None:
        """``events`` of one engine step of ``worker_id``, in order, at the step's end."""


class PlannerHook(Protocol):
    """Called every ``interval_ms`` of simulated time; may add or drain workers."""

    interval_ms: float

    def on_tick(self, now_ms: float, sim: "Simulation") -> None:
        """Observe ``sim`` at ``now_ms`` and act on it."""


@dataclass
class SimConfig:
    """Simulation settings.

    Attributes:
        workers: aggregated workers at start (>= 0; with ``decode_workers``
            at least one of the two, unless a planner starts them). Defaults to ``8``.
        policy: routing policy name (:data:`kvflow.router.policies.POLICIES`).
            Defaults to ``"round_robin"``.
        seed: seeds the engines' output tokens. Defaults to ``0``.
        mocker: engine settings per worker (its ``seed`` is replaced by
            ``seed``). Defaults to :class:`MockerConfig` defaults.
        model: model name the workers serve. Defaults to ``"mocker"``.
        sample_interval_ms: simulated time between timeline samples.
            Defaults to ``10000``.
        block_hashes: fill ``RouteRequest.block_hashes`` (costly); None =
            only for policies outside
            :data:`~kvflow.router.policies.HASH_FREE_POLICIES`.
        prefill_workers: prefill-only workers at start (>= 0). Defaults to ``0``.
        decode_workers: decode workers at start (>= 0). Defaults to ``0``.
            Either > 0 switches on the disaggregated mode (module docstring).
        disagg: the conditional-disaggregation thresholds. Defaults to
            :class:`~kvflow.router.disagg.DisaggConfig` defaults (1000 tokens, queue 2 per worker).
        worker_startup_ms: simulated ms from :meth:`Simulation.add_worker`
            until the new worker registers and takes requests (a real
            replica loads its model first); the workers present at start are
            ready at once. Defaults to ``0``.
        kv: weights of the ``kv``/``approx`` cost (as the live router's
            ``kv_*`` settings). None = the policy defaults.
        shed: load shedding and the queue (as the live router's ``shed_*``
            settings). Defaults to :class:`~kvflow.router.shedding.ShedConfig`
            defaults (the live defaults: reject above 95% KV use).
        router_tick_ms: simulated ms between the router core's ticks while
            it holds requests (queue mode). Defaults to ``1000`` (the live
            router ticks every ``heartbeat_interval_ms``, default 1000).
        pool_workers: aggregated workers at start per worker pool (pool name →
            count), beside ``workers`` (which join the default pool ``""``).
            Defaults to none.
        pool_grid: the global router's pool grid (:mod:`kvflow.router.pools`,
            the live ``router_pool_grid``); None = one pool. Defaults to ``None``.
        hop_ms: simulated ms of one hop through the broker (produce to
            consume). With ``hop_ms > 0`` the router decides on each arrival
            one hop after it arrived, a routed request reaches its worker's
            engine one hop after the decision (counted on the worker by the
            router meanwhile, as the live router counts its own decisions),
            and the workers' admission and finish records, KV events and
            heartbeats reach the router one hop after they were produced;
            heartbeats are then taken every ``heartbeat_interval_ms``, as live
            workers send them. ``0`` (default): every record is folded the
            moment it is produced and every worker's heartbeat is refreshed
            before each decision (the router sees the engines exactly).
            ``kvflow replay --from-topics`` measures it from the recording
            (:meth:`kvflow.replay.from_log.RecordedRun.hop_ms`).
        heartbeat_interval_ms: ms between a worker's heartbeats when
            ``hop_ms > 0``. Defaults to ``1000`` (the live
            ``heartbeat_interval_ms``).
    """

    workers: int = 8
    policy: str = "round_robin"
    seed: int = 0
    mocker: MockerConfig | None = None
    model: str = "mocker"
    sample_interval_ms: float = 10_000.0
    block_hashes: bool | None = None
    prefill_workers: int = 0
    decode_workers: int = 0
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    worker_startup_ms: float = 0.0
    kv: KvPolicyConfig | None = None
    shed: ShedConfig = field(default_factory=ShedConfig)
    router_tick_ms: float = 1000.0
    pool_workers: dict[str, int] = field(default_factory=dict)
    pool_grid: PoolGrid | None = None
    hop_ms: float = 0.0
    heartbeat_interval_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.worker_startup_ms < 0:
            raise ValueError(f"worker_startup_ms must be >= 0, got {self.worker_startup_ms}")
        if self.hop_ms < 0:
            raise ValueError(f"hop_ms must be >= 0, got {self.hop_ms}")
        if self.heartbeat_interval_ms <= 0:
            raise ValueError(f"heartbeat_interval_ms must be > 0, got {self.heartbeat_interval_ms}")
        if self.router_tick_ms <= 0:
            raise ValueError(f"router_tick_ms must be > 0, got {self.router_tick_ms}")


@dataclass
class SimWorker:
    """One simulated worker: its engine core and step bookkeeping.

    ``unstarted`` holds routed request ids not yet admitted by a step, in
    arrival order (the core admits first-come first-served). ``held`` are
    the requests it took and has not ended (what its in-flight records
    said); ``lifecycle_seq`` numbers those records, as a live worker does.
    """

    worker_id: str
    role: WorkerRole
    core: MockerCore
    busy_ms: float = 0.0
    stepping: bool = False
    pending: StepResult | None = None
    unstarted: deque[str] = field(default_factory=deque)
    draining: bool = False
    steps: int = 0
    ready_ms: float = 0.0  # registers with the router (takes requests) from then on
    held: set[str] = field(default_factory=set)
    lifecycle_seq: int = 0
    pool: str = ""


@dataclass
class _Handoff:
    """A remotely prefilled request between its arrival and its decode worker.

    ``request`` is the decode worker's request (full ``max_tokens``);
    ``prefill_cached`` the prefill worker's prefix hit (tokens);
    ``transfer_ms``/``moved_tokens`` the modelled KV transfer.
    """

    decode_worker_id: str
    request: GenerateRequest
    prefill_cached: int = 0
    transfer_ms: float = 0.0
    moved_tokens: int = 0


@dataclass
class SimResult:
    """What a simulation produced. ``itl_gaps_ms`` pools every inter-token gap;
    ``profile_s`` splits the run's wall time (routing, engine steps, token
    delivery, the rest).

    ``worker_roles`` maps worker id to role (``aggregated``/``prefill``/``decode``),
    ``worker_pools`` to its worker pool (``""``: the default pool);
    ``prefill_tokens``/``decode_tokens`` are each worker's computed prompt and
    decode tokens; ``prefill_plans`` counts the disaggregation rule's outcomes
    (:data:`kvflow.router.disagg.PlanReason`: ``remote``, ``short_prompt``,
    ``prefill_queue_full``, ``no_prefill_workers``), empty in aggregated mode.
    ``router_counts`` are the router core's counters
    (:data:`kvflow.router.core.COUNTERS`: ``routed``, ``queued``, ``shed``,
    ``rejected``, ``released``, ``queue_timeouts``, ...).

    KV tiers (all workers together): ``recomputed_prefill_tokens`` are prompt
    tokens computed again although some worker had computed their block
    before (evicted, or cached elsewhere); ``tier_cached_tokens`` splits the
    cached prompt tokens of requests that got their first token by the tier
    that served them (``device``, ``host``, ``disk``), over
    ``tier_prompt_tokens``, those requests' prompt tokens;
    ``tier_counters`` sums the workers' :class:`~kvflow.workers.kv.tiers.TierStats`
    (empty without tiers).
    """

    records: list[RequestRecord]
    itl_gaps_ms: array
    worker_ids: list[str]
    busy_ms: dict[str, float]
    timeline: list[TimelineSample]
    end_ms: float
    steps: int
    stalls: int
    wall_time_s: float
    profile_s: dict[str, float]
    worker_roles: dict[str, str] = field(default_factory=dict)
    worker_pools: dict[str, str] = field(default_factory=dict)
    prefill_tokens: dict[str, int] = field(default_factory=dict)
    decode_tokens: dict[str, int] = field(default_factory=dict)
    prefill_plans: dict[str, int] = field(default_factory=dict)
    router_counts: dict[str, int] = field(default_factory=dict)
    recomputed_prefill_tokens: int = 0
    tier_prompt_tokens: int = 0
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    tier_counters: dict[str, float] = field(default_factory=dict)

    @property
    def disaggregated(self) -> bool:
        """Whether any worker was a prefill or decode worker."""
        return any(role != WorkerRole.aggregated.value for role in self.worker_roles.values())


def _progress_bar(total: int, enabled: bool, desc: str = "simulating"):
    """Progress of ``total`` requests on stderr unless not ``enabled`` (:func:`kvflow.progress.progress`:
    a bar on a terminal, periodic plain lines otherwise)."""
    from kvflow.progress import progress

    return progress(total, desc, unit="req", enabled=enabled)


class Simulation:
    """A discrete-event simulation of one trace (see the module docstring).

    Args:
        trace: the requests (a :class:`Trace` or any iterable; sorted by ``arrival_ms`` here).
        config: simulation settings.
        kv_hook: optional KV event receiver.
        planner: optional periodic controller.
        progress: show a progress bar when stderr is a TTY.

    Raises:
        KeyError: unknown policy.
        ValueError: a negative worker count, or no aggregated and no decode worker
            and no planner (a pool may start empty when a planner starts its
            workers; its requests are held with ``ShedConfig.cold_start_hold_ms``).
    """

    def __init__(self, trace: Trace | Iterable[TraceRequest], config: SimConfig | None = None, *,
                 kv_hook: KvEventHook | None = None, planner: PlannerHook | None = None,
                 progress: bool = False) -> None:
        self.config = config = config or SimConfig()
        if min(config.workers, config.prefill_workers, config.decode_workers, *config.pool_workers.values()) < 0:
            raise ValueError("worker counts must be >= 0")
        if config.workers + config.decode_workers + sum(config.pool_workers.values()) < 1 and planner is None:
            raise ValueError(f"workers must be >= 1 (or decode_workers >= 1) without a planner to start them, "
                             f"got {config.workers}")
        if config.workers and config.decode_workers:
            log.warning("%d aggregated workers beside %d decode workers get no requests: the disaggregation "
                        "rule decodes on the decode pool whenever it has a worker", config.workers,
                        config.decode_workers)
        self.requests = sorted(trace.requests if isinstance(trace, Trace) else trace, key=lambda r: r.arrival_ms)
        self.mocker_config = replace(config.mocker or MockerConfig(), seed=config.seed)
        self.kv_hook = kv_hook
        self.planner = planner
        self.progress = progress
        # KV-event policies read the index the workers' events build, as in the live router
        # (unless kv_hook takes the events instead).
        self.core = RouterCore(config.policy, kv=config.kv, shed=config.shed, disagg=config.disagg,
                               router_id="sim", block_size=self.mocker_config.block_size if kv_hook is None else None,
                               pools=config.pool_grid)
        if kv_hook is None and self.core.uses_events:
            self.kv_hook = self.core
        self.workers: dict[str, SimWorker] = {}
        self.now_ms = 0.0
        need = config.block_hashes
        self.need_block_hashes = config.policy not in HASH_FREE_POLICIES if need is None else need
        self._hasher = PrefixHasher(self.mocker_config.block_size) if (
            self.need_block_hashes and 512 % self.mocker_config.block_size == 0) else None
        self._heap: list[tuple[float, int, int, str]] = []
        self._seq = 0
        self._foreground = 0  # events on the heap that keep the simulation alive (not _BACKGROUND)
        self._hop = config.hop_ms
        self._deliveries: dict[int, tuple] = {}  # heap seq → (fold, record) due then (_DELIVER)
        self._records: dict[str, RequestRecord] = {}
        self._last_token: dict[str, float] = {}
        self._itl = array("d")
        self._window = [0, 0, 0]  # prompt tokens, cached tokens, arrivals since the last sample
        self._stalls = 0
        self._bar = None
        self._ran = False
        self._disagg = False  # set when a prefill or decode worker exists
        self._prefilling: dict[str, _Handoff] = {}  # on a prefill worker's core
        self._transferring: dict[str, _Handoff] = {}  # KV in flight to the decode worker
        self._plans: Counter[str] = Counter()
        self._router_tick_due = False  # a _ROUTER_TICK is on the heap
        self._computed_blocks: set[int] = set()  # every prompt block computed on any worker (recompute count)
        for _ in range(config.workers):
            self.add_worker(startup_ms=0.0)
        for _ in range(config.prefill_workers):
            self.add_worker(WorkerRole.prefill, startup_ms=0.0)
        for _ in range(config.decode_workers):
            self.add_worker(WorkerRole.decode, startup_ms=0.0)
        for pool, count in config.pool_workers.items():
            for _ in range(count):
                self.add_worker(startup_ms=0.0, pool=pool)

    @property
    def table(self) -> RoutingTable:
        """The router core's routing table."""
        return self.core.table

    # ---- topology (planner / disaggregation hooks use these) ------------

    def add_worker(self, role: WorkerRole = WorkerRole.aggregated, startup_ms: float | None = None,
                   pool: str = "") -> str:
        """Start a new worker of ``role`` with an empty cache at the current time; returns its id.

        It takes requests after ``startup_ms`` (default ``config.worker_startup_ms``). Ids are ``worker-NNN`` (aggregated), ``prefill-NNN`` or ``decode-NNN``,
        numbered per role from 0. A prefill or decode worker switches the
        simulation to the disaggregated placement rule. ``pool``: the worker
        pool it joins (``""``: the default pool).
        """
        role = WorkerRole(role)
        n = sum(1 for w in self.workers.values() if w.role == role)
        worker_id = f"{_ROLE_PREFIX[role]}-{n:03d}"
        if role != WorkerRole.aggregated:
            self._disagg = True
        core = MockerCore(self.mocker_config, worker_id)
        core.computed_blocks = self._computed_blocks
        w = self.workers[worker_id] = SimWorker(worker_id, role, core, pool=pool,
                                                ready_ms=self.now_ms + (self.config.worker_startup_ms
                                                                        if startup_ms is None else startup_ms))
        if w.ready_ms > self.now_ms:
            self._push(w.ready_ms, _READY, worker_id)
        else:
            self._register(w)
        return worker_id

    def _register(self, w: SimWorker) -> None:
        """``w`` is ready: its first heartbeat, then (with ``hop_ms``) one every ``heartbeat_interval_ms``."""
        self._heartbeat(w)
        if self._hop:
            self._push(self.now_ms + self.config.heartbeat_interval_ms, _HEARTBEAT, w.worker_id)

    def drain_worker(self, worker_id: str) -> None:
        """Route nothing new to ``worker_id``; it finishes its in-flight requests.

        Raises:
            KeyError: unknown worker.
        """
        w = self.workers[worker_id]
        w.draining = True
        self._heartbeat(w)

    def _heartbeat(self, w: SimWorker) -> None:
        """Refresh the routing table's view of ``w`` from its engine, as a heartbeat would
        (nothing while it is still starting). The step in flight counts as prefill work
        still ahead, as the live mocker engine reports it."""
        if w.ready_ms > self.now_ms:
            return
        s = w.core.stats(w.pending)
        hb = WorkerHeartbeat(
            worker_id=w.worker_id, role=w.role, status=WorkerStatus.draining if w.draining else WorkerStatus.serving,
            model=self.config.model, engine="mocker", block_size=s.block_size, kv_total_blocks=s.total_blocks,
            kv_used_blocks=s.used_blocks, queue_topic="sim", queue_partition=0, active_requests=s.active_requests,
            waiting_requests=s.waiting_requests, active_prefill_tokens=s.active_prefill_tokens,
            ts_ms=int(self.now_ms), lifecycle_seq=w.lifecycle_seq, inflight_requests=len(w.held), pool=w.pool)
        self._to_router(self.core.on_heartbeat, hb)

    def _to_router(self, fold, record) -> None:
        """``fold(record)`` now, or one hop from now (``hop_ms``): a record reaching its consumer."""
        if not self._hop:
            fold(record)
            return
        self._deliver_at(self.now_ms + self._hop, fold, record)

    def _deliver_at(self, t: float, fold, record) -> None:
        """``fold(record)`` from the event loop at simulated time ``t``."""
        self._seq += 1
        self._deliveries[self._seq] = (fold, record)
        self._foreground += 1
        heapq.heappush(self._heap, (t, _DELIVER, self._seq, ""))

    def _admitted(self, w: SimWorker, request: GenerateRequest, prefill_tokens: int) -> None:
        """``w`` took ``request`` (its :class:`RequestAdmitted`, folded at once)."""
        w.held.add(request.request_id)
        self._to_router(self.core.on_request_admitted, RequestAdmitted(
            worker_id=w.worker_id, started_ms=0, seq=w.lifecycle_seq, request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids), prefill_tokens=max(0, prefill_tokens),
            max_tokens=request.sampling.max_tokens, ts_ms=int(self.now_ms)))
        w.lifecycle_seq += 1

    def _finished(self, w: SimWorker, request_id: str) -> None:
        """``request_id`` ended on ``w`` (its :class:`RequestFinished`, folded at once)."""
        w.held.discard(request_id)
        self._to_router(self._fold_finished, RequestFinished(
            worker_id=w.worker_id, started_ms=0, seq=w.lifecycle_seq, request_id=request_id,
            ts_ms=int(self.now_ms)))
        w.lifecycle_seq += 1

    def _fold_finished(self, record: RequestFinished) -> None:
        """The router folds a finish record; with requests held, one of them may then
        start (:meth:`RouterCore.release_freed`), from the event loop rather than
        inside the worker step that finished this one."""
        self.core.on_request_finished(record)
        if self.core.queue:
            self._deliver_at(self.now_ms, self._release_freed, None)

    def _release_freed(self, _: None) -> None:
        if not self._hop:
            for w in self.workers.values():
                self._heartbeat(w)
        for effect in self.core.release_freed(int(self.now_ms)):
            if isinstance(effect, Decision):  # as at a tick
                self._carry_out(effect)

    # ---- events ----------------------------------------------------------

    def _push(self, t: float, kind: int, worker_id: str) -> None:
        self._seq += 1
        if kind not in _BACKGROUND:
            self._foreground += 1
        heapq.heappush(self._heap, (t, kind, self._seq, worker_id))

    def _block_hashes(self, req: TraceRequest, tokens: list[int]) -> tuple[int, ...]:
        if self._hasher is not None and req.hash_ids is not None and req.token_ids is None:
            return tuple(self._hasher.block_hashes(req.hash_ids, req.isl))
        return tuple(compute_block_hashes(tokens, self.mocker_config.block_size))

    def dispatch(self, req: TraceRequest) -> None:
        """Hand one arrived request to the router core at ``now_ms`` and carry out its decision.

        Every worker's heartbeat is refreshed first. Routed: the local or
        remote path of the module docstring. Queued: held until a router
        tick releases it. Shed or rejected (no worker), or refused by the
        engine: recorded as the request's error.
        """
        if not self._hop:  # with hops, the router has what the periodic heartbeats brought
            for w in self.workers.values():
                self._heartbeat(w)
        tokens = req.prompt_token_ids()
        hashes = self._block_hashes(req, tokens) if self.need_block_hashes else ()
        deadline = None if req.timeout_ms is None else int(self.now_ms + req.timeout_ms)
        arrival = Arrival(req.request_id, self.config.model, req.isl, block_hashes=hashes, deadline_ms=deadline,
                          payload=(req, tokens), priority=req.priority, tenant=req.tenant,
                          session_id=req.session_id, max_tokens=req.osl, ttft_target_ms=req.ttft_target_ms,
                          itl_target_ms=req.itl_target_ms)
        self._carry_out(self.core.route(arrival, int(self.now_ms)))

    def _router_tick(self) -> None:
        """The router core's tick: release or drop held requests; tick again while some are held."""
        self._router_tick_due = False
        if not self._hop:
            for w in self.workers.values():
                self._heartbeat(w)
        for effect in self.core.tick(int(self.now_ms)):
            if isinstance(effect, Decision):  # the other effects need a broker, or events that can be lost
                self._carry_out(effect)
        self._schedule_router_tick()

    def _schedule_router_tick(self) -> None:
        """Put the router's next periodic tick (a multiple of ``router_tick_ms``) on the heap
        while the core holds requests."""
        if self._router_tick_due or not self.core.queue:
            return
        step = self.config.router_tick_ms
        self._router_tick_due = True
        self._push((self.now_ms // step + 1) * step, _ROUTER_TICK, "")

    def _carry_out(self, decision: Decision) -> None:
        """Act on one decision of the router core (a new request, or a held one released or dropped)."""
        req, tokens = decision.arrival.payload
        rec = self._records[req.request_id]
        outcome = decision.outcome
        if outcome is DecisionOutcome.routed:
            if self._hop:  # through the worker's queue topic
                self._to_router(lambda args: self._place(*args), (decision, req, rec, tokens))
            else:
                self._place(decision, req, rec, tokens)
        elif outcome is DecisionOutcome.queued:
            self._schedule_router_tick()
        else:
            self._fail(rec, f"{outcome.value}: {decision.reason}")
        for shed_one in decision.displaced:  # held requests a higher-ranked arrival pushed out
            self._carry_out(shed_one)

    def _place(self, decision: Decision, req: TraceRequest, rec: RequestRecord, tokens: list[int]) -> None:
        """A routed request: local prefill → its decode (or aggregated) worker; remote → the prefill
        worker with ``max_tokens = 1``, then the decode worker after the KV transfer. The core
        already counted it on those workers, as the live router does."""
        placement = decision.placement
        chosen, plan = placement.decision, placement.plan
        if self._disagg:
            self._plans[plan.reason] += 1
        rid, decode_id = req.request_id, chosen.worker_id
        rec.worker_id = decode_id
        request = GenerateRequest(rid, tokens, SamplingParams(max_tokens=req.osl, ignore_eos=True))
        if not plan.remote:
            decode = self.workers[decode_id]
            uncached = req.isl - chosen.overlap_blocks * decode.core.config.block_size
            self._enqueue(decode, rec, request, prefill_tokens=uncached)
            return
        prefill_id = chosen.prefill_worker_id
        rec.prefill_worker_id = prefill_id
        self._prefilling[rid] = _Handoff(decode_id, request)
        one = GenerateRequest(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        if not self._enqueue(self.workers[prefill_id], rec, one, prefill_tokens=req.isl):
            del self._prefilling[rid]
            self._finished(self.workers[decode_id], rid)

    def _enqueue(self, w: SimWorker, rec: RequestRecord, request: GenerateRequest, *,
                 kv_imported: bool = False, prefill_tokens: int = 0) -> bool:
        """Add ``request`` to ``w``'s core and make sure a step is coming; False (and the
        record failed, the request ended on ``w``) if the engine rejects it.
        ``prefill_tokens``: the prompt tokens the admission record says ``w`` computes."""
        try:
            w.core.add_request(request, kv_imported=kv_imported)
        except EngineError as exc:
            self._finished(w, request.request_id)
            self._fail(rec, str(exc))
            return False
        self._admitted(w, request, prefill_tokens)
        w.unstarted.append(request.request_id)
        if not w.stepping:
            w.stepping = True
            self._push(self.now_ms, _STEP_START, w.worker_id)
        return True

    def _fail(self, rec: RequestRecord, error: str) -> None:
        rec.error = error
        if self._bar is not None:
            self._bar.update(1)

    def _start_step(self, w: SimWorker) -> None:
        now = self.now_ms
        res = w.core.step(now_ms=now)
        if not res.outputs and not res.prefill_tokens and not res.decode_tokens:
            # Nothing could be scheduled; with the pool sized for every accepted
            # request this does not happen, but never spin on it.
            self._stalls += 1
            w.stepping = False
            return
        w.steps += 1
        w.busy_ms += res.duration_ms
        w.pending = res
        unstarted, records, has_seq = w.unstarted, self._records, w.core.pool.has_seq
        while unstarted and (has_seq(unstarted[0]) or unstarted[0] in res.outputs):
            rec = records[unstarted.popleft()]
            if rec.scheduled_ms is None:  # a decode worker importing KV does not reschedule it
                rec.scheduled_ms = now
        self._push(now + res.duration_ms, _STEP_END, w.worker_id)

    def _end_step(self, w: SimWorker) -> None:
        now = self.now_ms
        res, w.pending = w.pending, None
        records, last, itl, window = self._records, self._last_token, self._itl, self._window
        prefilling = self._prefilling
        for rid, out in res.outputs.items():
            if prefilling and rid in prefilling:
                self._finished(w, rid)
                self._prefill_done(rid, out)
                continue
            rec = records[rid]
            n = len(out.token_ids)
            prev = last.get(rid)
            if prev is None:
                rec.first_token_ms = now
                rec.cached_tokens = out.num_cached_tokens
                window[0] += rec.isl
                window[1] += out.num_cached_tokens
                n -= 1
            else:
                itl.append(now - prev)
                n -= 1
            if n > 0:  # several tokens in one delivery: zero gaps between them
                itl.extend([0.0] * n)
            rec.output_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                rec.last_token_ms = rec.finish_ms = now
                last.pop(rid, None)
                self._finished(w, rid)
                if out.finish_reason.value in ("abort", "error"):
                    rec.error = f"finished with {out.finish_reason.value}"
                if self._bar is not None:
                    self._bar.update(1)
            else:
                last[rid] = now
        if res.kv_events and self.kv_hook is not None:
            self._to_router(lambda ev, hook=self.kv_hook, wid=w.worker_id: hook.on_kv_events(wid, ev), res.kv_events)
        w.stepping = w.core.has_work()

    def _prefill_done(self, rid: str, out: EngineOutput) -> None:
        """A remote prefill sampled its token: start the KV transfer to the decode worker."""
        h = self._prefilling.pop(rid)
        rec = self._records[rid]
        if out.finish_reason is not FinishReason.length:
            self._finished(self.workers[h.decode_worker_id], rid)
            self._fail(rec, f"prefill finished with {out.finish_reason.value if out.finish_reason else None}")
            return
        h.prefill_cached = out.num_cached_tokens
        decode = self.workers[h.decode_worker_id]
        cfg = self.mocker_config
        # Only what the decode worker's prefix cache lacks moves (MockerEngine.generate_from_kv).
        h.moved_tokens = len(h.request.prompt_token_ids) - decode.core.cached_prompt_tokens(h.request)
        h.transfer_ms = kv_transfer_time_ms(cfg, h.moved_tokens) / cfg.speedup_ratio
        self._transferring[rid] = h
        self._push(self.now_ms + h.transfer_ms, _TRANSFER_END, rid)

    def _end_transfer(self, rid: str) -> None:
        """The KV arrived: the decode worker delivers the first token and decodes the rest."""
        h = self._transferring.pop(rid)
        now, rec = self.now_ms, self._records[rid]
        rec.first_token_ms = now
        rec.cached_tokens = h.prefill_cached
        rec.kv_transfer_ms = h.transfer_ms
        rec.kv_transfer_tokens = h.moved_tokens
        rec.output_tokens += 1
        self._window[0] += rec.isl
        self._window[1] += h.prefill_cached
        if h.request.sampling.max_tokens <= 1:
            rec.last_token_ms = rec.finish_ms = now
            self._finished(self.workers[h.decode_worker_id], rid)  # the decode worker answered at once
            if self._bar is not None:
                self._bar.update(1)
            return
        self._last_token[rid] = now
        if not self._enqueue(self.workers[h.decode_worker_id], rec, h.request, kv_imported=True):
            self._last_token.pop(rid, None)

    def _sample(self, t_ms: float, out: list[TimelineSample]) -> None:
        loads, usage = [], []
        for w in self.workers.values():
            s = w.core.stats()
            loads.append(s.active_requests + s.waiting_requests)
            usage.append(s.used_blocks / s.total_blocks if s.total_blocks else 0.0)
        p, c, a = self._window
        out.append(TimelineSample(t_ms, loads, usage, p, c, a))
        self._window = [0, 0, 0]

    # ---- the loop --------------------------------------------------------

    def run(self) -> SimResult:
        """Simulate the whole trace; returns records, pooled ITL gaps, busy times and timeline.

        Raises:
            RuntimeError: called a second time (engines keep their state).
            ValueError: request ids in the trace are not unique.
        """
        if self._ran:
            raise RuntimeError("a Simulation runs once; build a new one")
        self._ran = True
        t_wall = time.perf_counter()
        prof = {"routing": 0.0, "engine_step": 0.0, "delivery": 0.0}
        pc = time.perf_counter
        reqs = self.requests
        self._records = {r.request_id: RequestRecord(r.request_id, r.arrival_ms, r.isl, r.osl) for r in reqs}
        if len(self._records) != len(reqs):
            raise ValueError("request ids in the trace are not unique")
        timeline: list[TimelineSample] = []
        interval = self.config.sample_interval_ms
        next_sample = interval
        heap = self._heap
        if self.planner is not None:
            self._push(self.planner.interval_ms, _TICK, "")
        i, n = 0, len(reqs)
        inf = float("inf")
        self._bar = _progress_bar(n, self.progress)
        try:
            while True:
                t_arr = reqs[i].arrival_ms if i < n else inf
                # Ticks alone do not keep the simulation alive, unless the router holds requests
                # (a pool at zero: the planner's next tick starts the worker that serves them).
                live_heap = heap and (self._foreground > 0 or any(w.stepping for w in self.workers.values())
                                      or bool(self.core.queue))
                if t_arr == inf and not live_heap:
                    break
                t_next = t_arr if not heap or t_arr <= heap[0][0] else heap[0][0]
                while next_sample <= t_next:
                    self.now_ms = next_sample
                    self._sample(next_sample, timeline)
                    next_sample += interval
                self.now_ms = t_next
                if t_arr <= t_next:
                    i += 1
                    self._window[2] += 1
                    t0 = pc()
                    if self._hop:  # through the requests topic
                        self._to_router(self.dispatch, reqs[i - 1])
                    else:
                        self.dispatch(reqs[i - 1])
                    prof["routing"] += pc() - t0
                    continue
                _, kind, seq, worker_id = heapq.heappop(heap)
                if kind not in _BACKGROUND:
                    self._foreground -= 1
                if kind == _DELIVER:
                    fold, record = self._deliveries.pop(seq)
                    t0 = pc()
                    fold(record)
                    prof["routing"] += pc() - t0
                    continue
                if kind == _HEARTBEAT:
                    self._heartbeat(self.workers[worker_id])
                    self._push(t_next + self.config.heartbeat_interval_ms, _HEARTBEAT, worker_id)
                    continue
                if kind == _TICK:
                    self.planner.on_tick(t_next, self)
                    self._push(t_next + self.planner.interval_ms, _TICK, "")
                    continue
                if kind == _READY:
                    self._register(self.workers[worker_id])
                    continue
                if kind == _ROUTER_TICK:
                    t0 = pc()
                    self._router_tick()
                    prof["routing"] += pc() - t0
                    continue
                if kind == _TRANSFER_END:  # the key is a request id here
                    t0 = pc()
                    self._end_transfer(worker_id)
                    prof["delivery"] += pc() - t0
                    continue
                w = self.workers[worker_id]
                t0 = pc()
                if kind == _STEP_END:
                    self._end_step(w)
                    t1 = pc()
                    prof["delivery"] += t1 - t0
                    t0 = t1
                if w.stepping:  # a step start, or work left at a step end: the next step begins now
                    self._start_step(w)
                prof["engine_step"] += pc() - t0
        finally:
            self._bar.close()
            self._bar = None
        self._sample(self.now_ms, timeline)
        for rec in self._records.values():
            if rec.finish_ms is None and rec.error is None:
                rec.error = "unfinished: the engine could not schedule it"
        wall = time.perf_counter() - t_wall
        prof["other"] = wall - sum(prof.values())
        ws = self.workers.values()
        return SimResult(
            records=list(self._records.values()), itl_gaps_ms=self._itl, worker_ids=list(self.workers),
            busy_ms={w.worker_id: w.busy_ms for w in ws}, timeline=timeline,
            end_ms=self.now_ms, steps=sum(w.steps for w in ws), stalls=self._stalls,
            wall_time_s=wall, profile_s=prof,
            worker_roles={w.worker_id: w.role.value for w in ws},
            worker_pools={w.worker_id: w.pool for w in ws},
            prefill_tokens={w.worker_id: w.core.prefill_tokens_total for w in ws},
            decode_tokens={w.worker_id: w.core.decode_tokens_total for w in ws},
            prefill_plans=dict(self._plans),
            router_counts=dict(self.core.counters),
            **_tier_totals([w.core for w in ws]),
        )


def _tier_totals(cores: list[MockerCore]) -> dict:
    """The KV-tier fields of :class:`SimResult`, summed over ``cores``."""
    cached = Counter()
    counters: Counter = Counter()
    for core in cores:
        cached.update(core.cached_tokens_by_tier)
        if core.tiers is not None:
            counters.update({k: v for k, v in asdict(core.tiers.stats).items()
                             if k not in ("lookup_blocks", "device_hit_blocks")})
    return {"recomputed_prefill_tokens": sum(c.recomputed_prefill_tokens for c in cores),
            "tier_prompt_tokens": sum(c.first_token_prompt_tokens for c in cores),
            "tier_cached_tokens": {t: cached.get(t, 0) for t in ("device", "host", "disk")},
            "tier_counters": dict(counters)}


def simulate(trace: Trace | Iterable[TraceRequest], config: SimConfig | None = None, *,
             kv_hook: KvEventHook | None = None, planner: PlannerHook | None = None,
             progress: bool = False) -> SimResult:
    """Build a :class:`Simulation` and run it (arguments as there)."""
    return Simulation(trace, config, kv_hook=kv_hook, planner=planner, progress=progress).run()
