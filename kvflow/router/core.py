"""The router's decisions, pure and synchronous: :class:`RouterCore`.

One object holds what a router replica decides with — the routing table
(workers, their exact in-flight load, the KV index) and the bounded queue
of held requests — and is driven by inputs, each a method:

==================================  ==============================================  =====================
input                               from                                            returns
==================================  ==============================================  =====================
``on_heartbeat(hb)``                a :class:`~kvflow.schemas.WorkerHeartbeat`      nothing
``on_kv_batch(batch)``              a kv-events record, decoded                     a dump request or None
``on_kv_events(worker_id, events)`` KV events handed over in-process (no ids)       nothing
``on_request_admitted(record)``     a :class:`~kvflow.schemas.RequestAdmitted`      nothing
``on_request_finished(record)``     a :class:`~kvflow.schemas.RequestFinished`      nothing
``on_request_cancelled(rid)``       a :class:`~kvflow.schemas.CancelRequest`        effects
``release_freed(now_ms)``           after ``on_request_finished``                   effects
``route(arrival, now_ms)``          a new request                                   a :class:`Decision`
``tick(now_ms)``                    the clock (every heartbeat interval)            effects
==================================  ==============================================  =====================

No I/O, no clock reads, no asyncio: times are passed in (epoch ms live,
simulated ms offline). The live router (:mod:`kvflow.router.app`, Faust) and
the offline simulator (:mod:`kvflow.replay.simulator`) are adapters around
this one object, so what a replay measures is what runs live, load shedding
and the queue included. Deterministic: the same inputs in the same order
give the same decisions (policies draw any randomness from the request id).

Effects are plain dataclasses that the adapter carries out: live, as records
(a routed request on its worker's queue, an error
:class:`~kvflow.schemas.FinalResponse`, a
:class:`~kvflow.schemas.DecisionRecord`, a
:class:`~kvflow.schemas.KvDumpRequest`); offline, as simulated events.

* :class:`Decision` — what happened to one request: ``routed`` (send it to
  ``target``'s queue), ``queued`` (held here), ``shed`` (answer
  ``error``: every worker busy, the queue full, or its deadline passed
  while held) or ``rejected`` (answer ``error``: no worker serves the
  model). :meth:`RouterCore.route` returns one; :meth:`RouterCore.tick`
  emits one per held request it releases or drops.
* :class:`WorkerExpired` — a worker's heartbeats stopped for longer than its
  TTL; it left the table, and requests routed to it will not finish.
* :class:`KvDumpNeeded` — the KV index missed events of a worker; ask it
  for a full dump.
* :class:`Cancelled` — a held request was cancelled and dropped from the
  queue; answer it ``abort``.

Shedding and queueing follow :mod:`kvflow.router.shedding`: a request
arriving while every worker is busy is answered 503 (``reject`` mode) or
held (``queue`` mode; also while earlier requests are held, so they keep
their order). :meth:`RouterCore.tick` releases held requests, at most one
per serving worker per tick, since the busy test reads heartbeat figures
that lag the requests just released; it drops those whose deadline passed
(504) and rejects those whose model no worker serves any more (503,
so they do not block the queue's head). Between ticks, each finished
request releases at most one held request (:meth:`RouterCore.release_freed`):
one ended, one may start, so the queue drains as fast as the workers serve
instead of one request per worker per tick (offline, 600 Mooncake requests
at 30/s on 4 workers: 5.9 requests/s through the queue, 4.8 with ticks alone;
docs/benchmarks.md, "Queue mode").

**Cold start** (``ShedConfig.cold_start_hold_ms``, queue mode): a request
for a model that no worker serves is held instead of rejected — a pool
scaled to zero, whose first worker the planner is starting. Each tick
leaves such requests in the queue (they do not block the requests of
models that have workers) until a worker registers, and rejects them (503
``no_workers``) once held longer than the hold. Once a worker serves their
model they are released as they would have been routed on arrival: by the
busy test alone, without the one-per-worker-per-tick bound (they did not
queue behind busy workers), and arrivals from then on do not queue behind
them (for at most one tick, a new arrival may go ahead of them). :meth:`RouterCore.held`
tells a planner how many requests are held and for how long.

In ``priority`` queue order (:mod:`kvflow.router.fair_queue`) the queue
serves by priority class, then per-tenant fair share, then earliest
deadline; an arrival of a higher class than every held request goes to a
free worker at once instead of queueing behind them, and one arriving at a
full queue may displace a held request of a lower class (or of a tenant
holding more), which is shed (:attr:`Decision.displaced`). Requests with a
session id prefer their session's last worker (:mod:`kvflow.router.affinity`).
Requests naming a LoRA adapter (``lora_name``) are placed among the free
workers whose heartbeats list it, when any is free; otherwise among all
free workers of the base model, and the chosen one loads the adapter on
demand (:mod:`kvflow.workers.worker`). Their block hashes are salted with
the adapter name, so they never match the base model's blocks. The blocks
a media item's placeholders cover are hashed with its content hash
(:mod:`kvflow.schemas.media`), so only a worker holding the same image at
the same place overlaps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Union

from kvflow.router.affinity import DEFAULT_SESSION_MARGIN, SessionTable, prefer_session_worker
from kvflow.router.disagg import DisaggConfig, Placement, count_placement, decode_role, place
from kvflow.router.fair_queue import FairRequestQueue
from kvflow.router.pools import PoolChoice, PoolGrid
from kvflow.router.index import KvIndex
from kvflow.router.inflight import apply_inflight_record, kv_lagging, waive_kv
from kvflow.router.kv_policy import EVENT_POLICIES, KvPolicyConfig
from kvflow.router.policies import HASH_FREE_POLICIES, POLICIES, NoWorkerAvailable, RouteRequest
from kvflow.router.shedding import (
    BoundedRequestQueue,
    QueueFull,
    QueueOrder,
    ShedAction,
    ShedConfig,
    ShedMode,
    is_busy,
    shed,
)
from kvflow.router.table import RoutingTable, WorkerView, apply_heartbeat, expire_workers
from kvflow.schemas import (
    DecisionOutcome,
    InferenceRequest,
    KvEvent,
    KvEventBatch,
    KvWireBatch,
    RequestAdmitted,
    RequestFinished,
    WorkerHeartbeat,
    WorkerRole,
)
from kvflow.schemas.block_hash import BlockSizeMismatch, compute_block_hashes
from kvflow.schemas.media import media_block_hashes

__all__ = [
    "Arrival",
    "Cancelled",
    "Decision",
    "Effect",
    "ErrorReply",
    "KvDumpNeeded",
    "RouterCore",
    "WorkerExpired",
]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as the router sees it.

    Attributes:
        request_id: the request's id.
        model: the model it asks for.
        isl: prompt length, tokens.
        token_ids: the prompt's token ids, hashed into KV blocks at the
            chosen pool's block size when the policy reads block hashes
            (referenced, never copied); None when unknown.
        block_hashes: the prompt's chained block hashes when the caller
            already has them (the simulator); they replace ``token_ids`` for
            hashing.
        lora_name: the adapter the request runs with (part of its block hashes).
        created_ms: when the request was made (the decision time the
            ``approx`` policy ages its predictions with); 0 = unknown, the
            decision time is used.
        deadline_ms: absolute deadline on the ``now_ms`` clock; a request
            held past it is dropped. None = none.
        payload: what the adapter forwards and answers (the
            :class:`~kvflow.schemas.InferenceRequest` live, the trace request
            offline); the core never reads it.
        priority: the request's class; higher is served first by the
            ``priority`` queue order, and a full queue sheds the lowest class
            first (:mod:`kvflow.router.fair_queue`).
        tenant: who sent it (the bridge: a digest of the API key); the
            ``priority`` queue order shares releases fairly among tenants.
        session_id: requests of one session prefer the same worker
            (:mod:`kvflow.router.affinity`); None = no session.
        max_tokens: the output cap, tokens (the decode context a pool grid
            reads is ``isl + max_tokens``); 0 = unknown.
        ttft_target_ms, itl_target_ms: the caller's SLA hints (ms), read by
            a pool grid (:mod:`kvflow.router.pools`); None = its defaults.
        media_spans: ``(offset, num_tokens, content_hash)`` of each media
            item of the prompt (:mod:`kvflow.schemas.media`): the blocks they
            cover are hashed with the content hash.
    """

    request_id: str
    model: str
    isl: int
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[int] | None = None
    lora_name: str | None = None
    created_ms: int = 0
    deadline_ms: int | None = None
    payload: Any = None
    priority: int = 0
    tenant: str = ""
    session_id: str | None = None
    max_tokens: int = 0
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    media_spans: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def of(cls, request: InferenceRequest) -> "Arrival":
        """The arrival of a requests-topic record (its token ids shared, not
        copied; the row ids of its prompt embeddings, see
        :meth:`~kvflow.schemas.InferenceRequest.hash_ids`)."""
        tokens = request.hash_ids()
        return cls(request.request_id, request.model, len(tokens) if tokens else 0, tokens, None,
                   request.lora_name, request.created_ms, request.deadline_ms, request, request.priority,
                   request.tenant or "", request.session_id, request.sampling.max_tokens,
                   request.ttft_target_ms, request.itl_target_ms,
                   tuple(item.span for item in request.media or ()))


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The error a request is answered with: HTTP-like ``status`` (503, 504),
    a machine-readable ``code`` (``overloaded``, ``no_workers``,
    ``deadline_exceeded``), a human ``message`` and, for 503, ``Retry-After``
    seconds (None: no hint)."""

    status: int
    code: str
    message: str
    retry_after_s: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What the router did with one request (module docstring).

    Attributes:
        outcome: routed, queued, shed or rejected.
        arrival: the request.
        role: the pool it was decided over (``decode`` when the model has
            decode workers, else ``aggregated``).
        decided_ms: when (the ``now_ms`` of the call).
        placement: routed only: the policy's decision (stamped with router
            id and ``decided_ms``, with every candidate's cost terms) and
            the prefill plan.
        target: routed only: the worker whose queue receives the request
            (the prefill worker of a remote prefill, else ``decode_worker``).
        decode_worker: routed only: the worker that decodes it.
        reason: queued, shed, rejected: why, in a few words.
        error: shed and rejected: the answer the caller gets.
        expired: workers expired (TTL) just before deciding; each is also a
            :class:`WorkerExpired` to carry out.
        displaced: held requests shed (503) to make room for this one in a
            full ``priority`` queue; each is a ``shed`` decision to carry out.
        session_hit: routed only: the request went to its session's worker
            instead of the policy's choice (:mod:`kvflow.router.affinity`).
        pools: the pools the pool grid picked (:mod:`kvflow.router.pools`);
            None without a grid.
    """

    outcome: DecisionOutcome
    arrival: Arrival
    role: WorkerRole
    decided_ms: int
    placement: Placement | None = None
    target: WorkerView | None = None
    decode_worker: WorkerView | None = None
    reason: str | None = None
    error: ErrorReply | None = None
    expired: tuple[str, ...] = ()
    displaced: tuple["Decision", ...] = ()
    session_hit: bool = False
    pools: PoolChoice | None = None


@dataclass(frozen=True, slots=True)
class WorkerExpired:
    """``worker_id`` was silent longer than its TTL and left the table; the
    requests routed to it will not finish (live: answer them ``worker_lost``)."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class KvDumpNeeded:
    """The KV index missed events of ``worker_id``: ask it for a full dump."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A held request was cancelled and left the queue (answer it ``abort``)."""

    arrival: Arrival


Effect = Union[Decision, WorkerExpired, KvDumpNeeded, Cancelled]
"""What :meth:`RouterCore.tick` and :meth:`RouterCore.on_request_cancelled` return, in order."""

COUNTERS = ("routed", "queued", "shed", "rejected", "released", "queue_timeouts", "queue_cancelled",
            "kv_batches", "kv_gaps", "kv_mismatch", "inflight_records", "workers_expired", "displaced",
            "jumped", "session_hits", "pool_fallbacks", "cold_held", "handed_back")
"""The keys of :attr:`RouterCore.counters` the core maintains: decisions by outcome (``shed``
includes ``queue_timeouts``, held requests dropped at their deadline), held requests
``released`` and ``queue_cancelled``, KV batches folded, skipped (``kv_gaps``) and refused
(``kv_mismatch``), inflight records folded, and workers expired; in ``priority`` queue order,
held requests ``displaced`` by a higher-ranked arrival (also in ``shed``) and arrivals that
``jumped`` a queue of lower classes; routed requests sent to their session's worker
(``session_hits``); with a pool grid, requests whose decode pool had no worker and went to any
pool (``pool_fallbacks``); arrivals held because no worker served their model
(``cold_held``, also in ``queued``; ``cold_start_hold_ms``); held requests a stopping
replica ``handed_back`` to the others (:meth:`RouterCore.take_held`)."""


class RouterCore:
    """A router replica's state and decisions (see the module docstring).

    Args:
        policy: routing policy name (:data:`kvflow.router.policies.POLICIES`).
        kv: weights of the ``kv``/``approx`` cost; None = the policy defaults.
        shed: load-shedding settings; ``mode="queue"`` creates the bounded queue.
        disagg: conditional-disaggregation thresholds.
        router_id: stamped on every routing decision.
        block_size: tokens per KV block of the workers; with an event-fed
            policy (``kv``) it creates the KV index at once (needed by
            :meth:`on_kv_events`); None = on the first KV batch, at its size.
        pools: the global router's pool grid (:mod:`kvflow.router.pools`): each
            request is routed within the pools it picks; None = one pool.
        session_margin: session affinity's relative margin
            (:func:`~kvflow.router.affinity.prefer_session_worker`); None
            turns affinity off. Defaults to
            :data:`~kvflow.router.affinity.DEFAULT_SESSION_MARGIN`.

    Attributes:
        table: the routing table (workers, in-flight load, KV index).
        queue: the held requests (:class:`Arrival` items), None unless ``queue`` mode: a
            :class:`~kvflow.router.fair_queue.FairRequestQueue` in ``priority`` order, else a
            :class:`~kvflow.router.shedding.BoundedRequestQueue`.
        sessions: session id → worker of its latest routed request.
        counters: event counts by name (:data:`COUNTERS`); adapters may add their own keys.

    Raises:
        KeyError: unknown policy.
    """

    def __init__(self, policy: str, *, kv: KvPolicyConfig | None = None, shed: ShedConfig | None = None,
                 disagg: DisaggConfig | None = None, router_id: str = "", block_size: int | None = None,
                 pools: PoolGrid | None = None, session_margin: float | None = DEFAULT_SESSION_MARGIN) -> None:
        if policy not in POLICIES:
            raise KeyError(f"unknown routing policy {policy!r}; known: {sorted(POLICIES)}")
        self.policy = policy
        self.router_id = router_id
        self.shed_config = shed or ShedConfig()
        self.disagg_config = disagg or DisaggConfig()
        self.table = RoutingTable(kv_config=kv)
        self.uses_events = policy in EVENT_POLICIES
        self.needs_hashes = policy not in HASH_FREE_POLICIES
        if self.uses_events and block_size is not None:
            self.table.kv_index = KvIndex(block_size)
        cfg = self.shed_config
        self.queue: BoundedRequestQueue[Arrival] | FairRequestQueue[Arrival] | None = None
        self.prioritized = cfg.queue_order is QueueOrder.priority
        if cfg.mode is ShedMode.queue:
            self.queue = (FairRequestQueue(cfg.queue_capacity) if self.prioritized
                          else BoundedRequestQueue(cfg.queue_capacity, cfg.queue_order))
        self.session_margin = session_margin
        self.pool_grid = pools
        self.sessions = SessionTable()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._started_ms: dict[str, int] = {}
        self._held_ms: dict[str, int] = {}  # request id -> when it was queued (every held request)
        self._cold: set[str] = set()  # held requests queued because no worker served their model

    # ---- inputs: the log ---------------------------------------------------

    def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        """Fold a heartbeat into the table (:func:`~kvflow.router.table.apply_heartbeat`).

        A stopped worker, or one restarted under the same id (new
        ``started_ms``: its KV event ids start again at 0), loses its blocks
        in the KV index. A heartbeat older than the one held changes nothing.
        """
        table = self.table
        wid = hb.worker_id
        held = table.workers.get(wid)
        if held is not None and hb.ts_ms < held.last_seen_ms:
            return
        apply_heartbeat(table, hb)
        previous = self._started_ms.get(wid)
        gone = wid not in table.workers
        if gone:
            self._started_ms.pop(wid, None)
        else:
            self._started_ms[wid] = hb.started_ms
        index = table.kv_index
        if isinstance(index, KvIndex) and (gone or (previous is not None and previous != hb.started_ms)):
            index.remove_worker(wid)

    def on_kv_batch(self, batch: KvEventBatch | KvWireBatch) -> KvDumpNeeded | None:
        """Fold one worker's KV event batch into the index (created at its block
        size on the first batch); returns a dump request when event ids were
        skipped (:meth:`~kvflow.router.index.KvIndex.apply`). Ignored unless
        the policy is event-fed.

        Raises:
            BlockSizeMismatch: the batch's block size is not the index's
                (counted in ``kv_mismatch``; the batch is refused).
        """
        if not self.uses_events:
            return None
        index = self.table.kv_index
        if index is None:
            index = self.table.kv_index = KvIndex(batch.block_size)
        try:
            result = index.apply(batch)
        except BlockSizeMismatch:
            self.counters["kv_mismatch"] += 1
            raise
        self.counters["kv_batches"] += 1
        if result.gap:
            self.counters["kv_gaps"] += 1
            return KvDumpNeeded(batch.worker_id)
        return None

    def on_kv_events(self, worker_id: str, events: list[KvEvent]) -> None:
        """Apply KV events handed over in-process, in order, with no event ids
        (a feed that cannot lose or repeat events: the simulator's engines).
        Ignored unless the policy is event-fed and the index exists
        (``block_size`` given)."""
        index = self.table.kv_index
        if self.uses_events and index is not None:
            index.on_kv_events(worker_id, events)

    def on_request_admitted(self, record: RequestAdmitted) -> None:
        """A worker took a request (:func:`~kvflow.router.inflight.apply_inflight_record`)."""
        self.counters["inflight_records"] += 1
        apply_inflight_record(self.table, record)

    def on_request_finished(self, record: RequestFinished) -> None:
        """A request ended on a worker, whatever the outcome; it leaves the worker's load at once."""
        self.counters["inflight_records"] += 1
        apply_inflight_record(self.table, record)

    def on_request_cancelled(self, request_id: str) -> list[Effect]:
        """A cancel record: drop the request if it is held here (a :class:`Cancelled`
        effect); a request already routed is the worker's to abort."""
        queue = self.queue
        if not queue:
            return []
        gone = queue.remove(lambda a: a.request_id == request_id)
        self.counters["queue_cancelled"] += len(gone)
        self._held_ms.pop(request_id, None)
        self._cold.discard(request_id)
        return [Cancelled(a) for a in gone]

    def release_freed(self, now_ms: int) -> list[Effect]:
        """After a finish record (:meth:`on_request_finished`): release at most
        one held request, in queue order and only if the busy test lets it go,
        as a tick would; held requests past their deadline are shed on the way.
        Returns the effects (:class:`Decision`\ s) in order; none outside
        ``queue`` mode or with nothing held."""
        effects: list[Effect] = []
        if self.queue:
            self._release(now_ms, effects, budget=1)
        return effects

    def take_held(self) -> list[Arrival]:
        """Empty the queue of held requests and return them, in release order
        (a stopping replica hands them to the others; see :mod:`kvflow.router.serve`).
        Counted in ``handed_back``; an empty list outside ``queue`` mode."""
        queue = self.queue
        taken: list[Arrival] = []
        while queue:
            taken.append(queue.pop())
        self._held_ms.clear()
        self._cold.clear()
        self.counters["handed_back"] += len(taken)
        return taken

    # ---- decisions -----------------------------------------------------------

    def route(self, arrival: Arrival, now_ms: int) -> Decision:
        """Decide what to do with a new request at ``now_ms``.

        Workers past their TTL are expired first (:attr:`Decision.expired`).
        Then, over the serving workers of the model's decode pool (else its
        aggregated pool): none → ``rejected``; all busy → ``shed``
        (``reject`` mode, or the queue full) or ``queued``; earlier
        requests held → ``queued``; otherwise the policy picks among the
        workers that are not busy, the disaggregation rule decides where the
        prompt is prefilled, and the request is counted on its workers →
        ``routed``. With a pool grid all of this happens within the pools it
        picks (:attr:`Decision.pools`).
        """
        if self.pool_grid is None:
            return self._route(arrival, now_ms)
        choice = self._enter_pools(arrival)
        try:
            decision = self._route(arrival, now_ms)
        finally:
            self.table.pools = None
        return replace(decision, pools=choice)

    def _enter_pools(self, arrival: Arrival, count: bool = True) -> PoolChoice:
        """Restrict the table's candidates to the pools the grid picks for ``arrival``
        (every pool when its decode pool has no serving worker of the model; ``count``:
        in ``pool_fallbacks``)."""
        grid, table = self.pool_grid, self.table
        choice = grid.choose(arrival.isl, arrival.max_tokens, arrival.ttft_target_ms, arrival.itl_target_ms)
        table.pools = (choice.prefill, choice.decode)
        if not table.candidates(arrival.model, decode_role(table, arrival.model)):
            table.pools = None
            self.counters["pool_fallbacks"] += count
            return PoolChoice(choice.prefill, choice.decode, fallback=True)
        return choice

    def _route(self, arrival: Arrival, now_ms: int) -> Decision:
        expired = self._expire(now_ms)
        table = self.table
        role = decode_role(table, arrival.model)
        candidates = table.candidates(arrival.model, role)
        queue = self.queue
        cfg = self.shed_config.for_priority(arrival.priority)
        # Requests held for a cold start did not queue behind busy workers: an arrival does not wait for them.
        verdict = shed(candidates, cfg, queued=len(queue) - len(self._cold) if queue is not None else 0)
        action = verdict.action
        if action is ShedAction.queue and len(queue) >= cfg.queue_capacity:
            action = ShedAction.reject  # full of requests held for a cold start
        if not candidates and self.shed_config.cold_start_hold_ms is not None and queue is not None \
                and len(queue) < self.shed_config.queue_capacity:
            self._hold(arrival, now_ms)
            self._cold.add(arrival.request_id)
            self.counters["cold_held"] += 1
            return Decision(DecisionOutcome.queued, arrival, role, now_ms, expired=expired,
                            reason="no worker serves the model yet: held while one starts")
        if action is ShedAction.route or not candidates:
            return self._dispatch(arrival, role, candidates, verdict.candidates, now_ms, expired)
        if self.prioritized and action is ShedAction.queue and queue and arrival.priority > queue.peek_priority():
            # Held requests are all of lower classes: a free worker takes this one at once.
            free = [w for w in candidates if not is_busy(w, cfg)]
            if free:
                self.counters["jumped"] += 1
                return self._dispatch(arrival, role, candidates, free, now_ms, expired)
        reason = f"all workers are busy ({verdict.reason})"
        if action is ShedAction.queue:  # shed() queues only while the queue has room
            self._hold(arrival, now_ms)
            return Decision(DecisionOutcome.queued, arrival, role, now_ms, reason=reason, expired=expired)
        if self.prioritized and queue:
            try:
                victim = queue.displace(arrival, arrival.isl, arrival.deadline_ms, priority=arrival.priority,
                                        tenant=arrival.tenant)
            except QueueFull:
                victim = None
            else:
                self._held_ms[arrival.request_id] = now_ms
                self._held_ms.pop(victim.request_id, None)
                self._cold.discard(victim.request_id)
                self.counters["queued"] += 1
                self.counters["shed"] += 1
                self.counters["displaced"] += 1
                why = "pushed out of the full queue by a request that ranks higher"
                out = Decision(DecisionOutcome.shed, victim, decode_role(table, victim.model), now_ms, reason=why,
                               error=ErrorReply(503, "overloaded", why, verdict.retry_after_s))
                return Decision(DecisionOutcome.queued, arrival, role, now_ms, reason=reason, expired=expired,
                                displaced=(out,))
        self.counters["shed"] += 1
        return Decision(DecisionOutcome.shed, arrival, role, now_ms, reason=reason, expired=expired,
                        error=ErrorReply(503, "overloaded", reason, verdict.retry_after_s))

    def evaluate(self, arrival: Arrival, now_ms: int) -> Placement | None:
        """The placement the policy would choose for ``arrival`` at ``now_ms``,
        changing nothing the next decision reads (no expiry, shedding, queue
        or in-flight counting; a stateful policy such as round-robin still
        advances its own cursor). A shadow router asks this. ``None``: no
        serving worker of the model. With a pool grid, within the pools it picks.
        """
        if self.pool_grid is not None:
            self._enter_pools(arrival, count=False)
        try:
            role = decode_role(self.table, arrival.model)
            candidates = self.table.candidates(arrival.model, role)
            if not candidates:
                return None
            return self._place(arrival, role, candidates, now_ms)
        except NoWorkerAvailable:
            return None
        finally:
            self.table.pools = None

    def tick(self, now_ms: int) -> list[Effect]:
        """Periodic work at ``now_ms``, as effects in order: workers past their
        TTL expire (:class:`WorkerExpired`); workers whose KV events the index
        missed are asked for a dump (:class:`KvDumpNeeded`, each tick until it
        comes); held requests past their deadline are shed (504), and the
        others are released while some worker is not busy, at most one per
        serving worker (each a :class:`Decision`; see the module docstring).
        """
        effects: list[Effect] = [WorkerExpired(w) for w in self._expire(now_ms)]
        index = self.table.kv_index
        if isinstance(index, KvIndex):
            workers = self.table.workers
            effects.extend(KvDumpNeeded(w) for w in index.workers_needing_dump() if w in workers)
        if self.queue:
            self._release(now_ms, effects)
        return effects

    # ---- queries for adapters -------------------------------------------------

    def held(self, now_ms: int) -> tuple[int, int]:
        """Requests held in the queue now and the age of the oldest, ms (``(0, 0)``: none).

        A planner reads this to see demand no worker serves yet: requests
        held for a cold start show here before any of them finishes.
        """
        if not self._held_ms:
            return 0, 0
        return len(self._held_ms), max(0, now_ms - min(self._held_ms.values()))

    def kv_lagging(self, worker_ids: Sequence[str] | None = None) -> list[str]:
        """Workers whose finished requests' KV events the index has not folded yet
        (:func:`~kvflow.router.inflight.kv_lagging`; default: every worker in the table)."""
        return kv_lagging(self.table, self._kv_cursor, self.table.workers if worker_ids is None else worker_ids)

    def waive_kv(self, worker_ids: Sequence[str]) -> None:
        """Stop waiting for these workers' KV events until their index cursor moves
        (:func:`~kvflow.router.inflight.waive_kv`)."""
        for worker_id in worker_ids:
            waive_kv(self.table, worker_id, self._kv_cursor(worker_id))

    # ---- internals -------------------------------------------------------------

    def _kv_cursor(self, worker_id: str) -> int | None:
        index = self.table.kv_index
        return index.last_event_id(worker_id) if isinstance(index, KvIndex) else None

    def _expire(self, now_ms: int) -> tuple[str, ...]:
        gone = expire_workers(self.table, now_ms)
        if not gone:
            return ()
        self.counters["workers_expired"] += len(gone)
        index = self.table.kv_index
        for worker_id in gone:
            self._started_ms.pop(worker_id, None)
            self.sessions.forget_worker(worker_id)
            if isinstance(index, KvIndex):
                index.remove_worker(worker_id)
        return tuple(gone)

    def _hold(self, arrival: Arrival, now_ms: int) -> None:
        """Put ``arrival`` in the queue (which has room) and note when."""
        self.queue.push(arrival, isl=arrival.isl, deadline_ms=arrival.deadline_ms, priority=arrival.priority,
                        tenant=arrival.tenant)
        self._held_ms[arrival.request_id] = now_ms
        self.counters["queued"] += 1

    def _cold_waiting(self, arrival: Arrival, now_ms: int) -> bool:
        """Whether ``arrival`` (whose model has no serving worker) stays held for a cold start."""
        hold = self.shed_config.cold_start_hold_ms
        return hold is not None and now_ms - self._held_ms.get(arrival.request_id, now_ms) <= hold

    def _dispatch(self, arrival: Arrival, role: WorkerRole, candidates: list[WorkerView],
                  free: Sequence[WorkerView], now_ms: int, expired: tuple[str, ...] = ()) -> Decision:
        """Place ``arrival`` among ``free`` (the candidates that are not busy) and count it."""
        table = self.table
        lora = arrival.lora_name
        if lora:  # prefer workers with the adapter loaded; else the best worker loads it on demand
            holders = [w for w in free if lora in w.lora_adapters]
            if holders:
                free = holders
        if len(free) != len(candidates):  # the policy must not see a busy worker
            free_ids = {w.worker_id for w in free}
            table.busy = frozenset(w.worker_id for w in candidates if w.worker_id not in free_ids)
        try:
            placement = self._place(arrival, role, candidates, now_ms)
        except NoWorkerAvailable as exc:
            self.counters["rejected"] += 1
            return Decision(DecisionOutcome.rejected, arrival, role, now_ms, reason=str(exc), expired=expired,
                            error=ErrorReply(503, "no_workers", str(exc)))
        finally:
            table.busy = frozenset()
        decision = placement.decision.model_copy(update={"router_id": self.router_id, "decided_ms": now_ms})
        session_hit = False
        sid = arrival.session_id
        if sid is not None and self.session_margin is not None:
            sticky = self.sessions.get(sid)
            if sticky is not None and not placement.plan.remote:
                moved = prefer_session_worker(decision, sticky, self.session_margin, [w.worker_id for w in free])
                if moved is not None:
                    decision, session_hit = moved, True
                    self.counters["session_hits"] += 1
            self.sessions.note(sid, decision.worker_id)
        placement = Placement(decision, placement.plan)
        count_placement(table, placement, arrival.request_id, arrival.isl, now_ms, arrival.max_tokens)
        workers = table.workers
        decode = workers[decision.worker_id]
        target = workers[decision.prefill_worker_id] if placement.plan.remote else decode
        self.counters["routed"] += 1
        return Decision(DecisionOutcome.routed, arrival, role, now_ms, placement, target, decode, expired=expired,
                        session_hit=session_hit)

    def _place(self, arrival: Arrival, role: WorkerRole, candidates: list[WorkerView], now_ms: int) -> Placement:
        """The policy's placement of ``arrival`` over the table's candidates (busy ones already marked).

        Raises:
            NoWorkerAvailable: no worker of the model and role.
        """
        hashes: Sequence[int] = ()
        if self.needs_hashes and candidates:
            hashes = arrival.block_hashes
            if hashes is None:
                tokens = arrival.token_ids
                block_size = candidates[0].block_size
                mm = media_block_hashes(arrival.media_spans, block_size) if arrival.media_spans else None
                hashes = compute_block_hashes(tokens, block_size, arrival.lora_name, mm) if tokens else ()
        req = RouteRequest(arrival.request_id, arrival.model, arrival.isl, role, hashes, arrival.lora_name,
                           arrival.created_ms or now_ms)
        return place(self.policy, req, self.table, self.disagg_config, role)

    def _release(self, now_ms: int, effects: list[Effect], budget: int | None = None) -> None:
        """Shed held requests past their deadline, then release the others in queue order:
        at most ``budget`` (None: one per candidate worker), cold-start ones not counted."""
        queue, table = self.queue, self.table
        for arrival in queue.pop_expired(now_ms):
            self._held_ms.pop(arrival.request_id, None)
            self._cold.discard(arrival.request_id)
            self.counters["shed"] += 1
            self.counters["queue_timeouts"] += 1
            reason = "deadline passed while queued for a free worker"
            effects.append(Decision(DecisionOutcome.shed, arrival, decode_role(table, arrival.model), now_ms,
                                    reason=reason, error=ErrorReply(504, "deadline_exceeded", reason)))
        released = 0
        parked: list[Arrival] = []  # held for a cold start: back in the queue after this tick
        while queue:
            arrival = queue.peek()
            choice = self._enter_pools(arrival) if self.pool_grid is not None else None
            try:
                role = decode_role(table, arrival.model)
                candidates = table.candidates(arrival.model, role)
                cold = arrival.request_id in self._cold
                if candidates:
                    if released >= (len(candidates) if budget is None else budget) and not cold:
                        break  # heartbeats lag: one per worker per tick, one per finish record
                    verdict = shed(candidates, self.shed_config.for_priority(arrival.priority))
                    if verdict.action is not ShedAction.route:
                        break  # every worker (of its pool) still busy
                    # A cold-start request goes as it would have on arrival, had the worker been there.
                    released += not cold
                    self.counters["released"] += 1
                elif self._cold_waiting(arrival, now_ms):
                    parked.append(queue.pop())
                    continue
                queue.pop()
                self._held_ms.pop(arrival.request_id, None)
                self._cold.discard(arrival.request_id)
                decision = self._dispatch(arrival, role, candidates, verdict.candidates if candidates else (),
                                          now_ms)
            finally:
                table.pools = None
            effects.append(decision if choice is None else replace(decision, pools=choice))
        for arrival in parked:  # in their order; they never exceed the room they just left
            queue.push(arrival, isl=arrival.isl, deadline_ms=arrival.deadline_ms, priority=arrival.priority,
                       tenant=arrival.tenant)
