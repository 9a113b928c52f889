"""Conditional disaggregation: where a request decodes, and whether its prefill runs elsewhere.

The decision is pure (no I/O, no clock), so the live router, its replicas and
the offline simulator decide identically; :func:`forward` is the thin I/O
glue the router calls after it.

Rule (:func:`decide_prefill`), after the routing policy picked the decode
worker over the ``decode`` pool (the ``aggregated`` pool when no decode
worker serves the model)::

    uncached = ISL − overlap_blocks · block_size          (overlap: the decode worker's cached prefix)
    depth    = Σ over serving prefill workers (waiting_requests + routed_since_heartbeat)
               (reconciled figures: :class:`~kvflow.router.table.WorkerView`)
    remote   ⇔ prefill workers exist
               ∧ uncached > prefill_threshold_tokens
               ∧ depth < max_prefill_queue_per_worker · (number of prefill workers)

Otherwise the decode worker prefills the prompt itself. A short prompt, or
one mostly cached on the decode worker, costs less to prefill in place than
to prefill elsewhere and move; a backed-up prefill pool would add queueing
to the time to first token. This is Dynamo's conditional disaggregation
(``PyDisaggregatedRouter.prefill_remote``: ``absolute_prefill_length >
max_local_prefill_length and queue_size < max_prefill_queue_size``, defaults
1000 tokens and 2); kvflow scales the queue limit with the prefill pool size
so the planner can grow the pool without retuning it. When remote, the
prefill worker is chosen by the same routing policy over the prefill pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvflow.router.inflight import note_routed_request
from kvflow.router.policies import RouteRequest, select_worker
from kvflow.router.table import RoutingTable, WorkerView
from kvflow.schemas import InferenceRequest, RoutingDecision, WorkerRole, encode
from kvflow.schemas.transfer import PrefillStage

__all__ = [
    "DisaggConfig",
    "PrefillPlan",
    "Placement",
    "Send",
    "decode_role",
    "prefill_queue_depth",
    "decide_prefill",
    "place",
    "forward",
    "route_and_forward",
]

PlanReason = Literal["remote", "short_prompt", "prefill_queue_full", "no_prefill_workers"]

Send = Callable[[str, int, bytes, bytes], Awaitable[Any]]
"""``send(topic, partition, key, value)``: produce one record (the router's producer)."""


@dataclass(frozen=True)
class DisaggConfig:
    """Thresholds of the conditional-disaggregation rule.

    Attributes:
        prefill_threshold_tokens: prefill remotely only when the uncached
            prompt is longer than this. Defaults to ``1000`` (Dynamo's
            ``max_local_prefill_length``).
        max_prefill_queue_per_worker: prefill remotely only while the prefill
            pool's queue depth is below this times the number of prefill
            workers. Defaults to ``2`` (Dynamo's ``max_prefill_queue_size``).

    Raises:
        ValueError: a negative threshold or a limit < 1.
    """

    prefill_threshold_tokens: int = 1000
    max_prefill_queue_per_worker: int = 2

    def __post_init__(self) -> None:
        if self.prefill_threshold_tokens < 0:
            raise ValueError(f"prefill_threshold_tokens must be >= 0, got {self.prefill_threshold_tokens}")
        if self.max_prefill_queue_per_worker < 1:
            raise ValueError(f"max_prefill_queue_per_worker must be >= 1, got {self.max_prefill_queue_per_worker}")

    @classmethod
    def from_settings(cls, settings: Any) -> DisaggConfig:
        """Read ``disagg_prefill_threshold_tokens`` and
        ``disagg_max_prefill_queue_per_worker`` from :class:`~kvflow.settings.Settings`
        (class defaults for fields a Settings version does not have)."""
        return cls(
            prefill_threshold_tokens=getattr(settings, "disagg_prefill_threshold_tokens", cls.prefill_threshold_tokens),
            max_prefill_queue_per_worker=getattr(settings, "disagg_max_prefill_queue_per_worker",
                                                 cls.max_prefill_queue_per_worker),
        )


@dataclass(frozen=True)
class PrefillPlan:
    """Where one request's prefill runs.

    ``prefill`` is the prefill pool's routing decision when ``remote``, else
    None. ``uncached_tokens`` and ``queue_depth`` are the rule's inputs (for
    logs and tests); ``reason`` names the clause that decided.
    """

    remote: bool
    reason: PlanReason
    uncached_tokens: int
    queue_depth: int
    prefill: RoutingDecision | None = None


@dataclass(frozen=True)
class Placement:
    """The decode worker's decision (``prefill_worker_id`` filled when remote) and the plan."""

    decision: RoutingDecision
    plan: PrefillPlan


def decode_role(table: RoutingTable, model: str) -> WorkerRole:
    """``decode`` if a serving decode worker serves ``model``, else ``aggregated``."""
    return WorkerRole.decode if table.candidates(model, WorkerRole.decode) else WorkerRole.aggregated


def prefill_queue_depth(prefill_workers: list[WorkerView]) -> int:
    """Requests waiting on the prefill pool: reported waiting + routed since each heartbeat."""
    return sum(w.waiting_requests + w.routed_since_heartbeat for w in prefill_workers)


def decide_prefill(policy: str, req: RouteRequest, decision: RoutingDecision, table: RoutingTable,
                   config: DisaggConfig) -> PrefillPlan:
    """Apply the rule of the module docstring to a request already placed on ``decision.worker_id``.

    ``req.isl`` is the prompt length in tokens; the decode worker's
    ``block_size`` converts ``decision.overlap_blocks`` to tokens. The prefill
    policy runs only when every other clause allows a remote prefill, so a
    stateful policy (round robin) advances only for requests it places.

    Raises:
        KeyError: ``decision.worker_id`` is not in ``table`` or ``policy`` is unknown.
    """
    worker = table.workers[decision.worker_id]
    uncached = max(0, req.isl - decision.overlap_blocks * worker.block_size)
    prefill_workers = table.candidates(req.model, WorkerRole.prefill)
    depth = prefill_queue_depth(prefill_workers)
    if not prefill_workers:
        return PrefillPlan(False, "no_prefill_workers", uncached, depth)
    if uncached <= config.prefill_threshold_tokens:
        return PrefillPlan(False, "short_prompt", uncached, depth)
    if depth >= config.max_prefill_queue_per_worker * len(prefill_workers):
        return PrefillPlan(False, "prefill_queue_full", uncached, depth)
    prefill = select_worker(policy, dataclasses.replace(req, role=WorkerRole.prefill), table)
    return PrefillPlan(True, "remote", uncached, depth, prefill)


def place(policy: str, req: RouteRequest, table: RoutingTable, config: DisaggConfig) -> Placement:
    """Pick the decode worker (decode pool, else aggregated pool), then where to prefill.

    Raises:
        kvflow.router.policies.NoWorkerAvailable: no decode or aggregated worker serves ``req.model``.
        KeyError: unknown ``policy``.
    """
    decision = select_worker(policy, dataclasses.replace(req, role=decode_role(table, req.model)), table)
    plan = decide_prefill(policy, req, decision, table, config)
    if plan.remote:
        decision = decision.model_copy(update={"prefill_worker_id": plan.prefill.worker_id})
    return Placement(decision, plan)


async def forward(request: InferenceRequest, placement: Placement, table: RoutingTable, send: Send, *,
                  now_ms: int = 0) -> None:
    """Send ``request`` where ``placement`` says, and count it on the chosen workers
    (:func:`~kvflow.router.inflight.note_routed_request` at ``now_ms``, epoch ms).

    Local prefill: to the decode worker's queue partition, with
    ``disaggregated_params`` cleared (a client cannot inject a stage).
    Remote: to the prefill worker's queue partition with a
    :class:`~kvflow.schemas.transfer.PrefillStage` naming the decode worker's
    queue partition. ``placement.decision`` (already stamped with router id
    and time) becomes ``request.routing``.

    Work counted: locally, the decode worker computes the prompt less its
    cached overlap; remotely, the prefill worker computes the whole prompt
    (as its admission record will say: the stage does not carry the
    prefill pool's overlap) and the decode worker none (it imports the KV).

    Raises:
        KeyError: a worker of the placement is no longer in ``table``.
    """
    decision = placement.decision
    decode = table.workers[decision.worker_id]
    key = request.request_id.encode()
    rid = request.request_id
    isl = len(request.token_ids) if request.token_ids else 0
    if not placement.plan.remote:
        routed = request.model_copy(update={"routing": decision, "disaggregated_params": None})
        note_routed_request(table, decode.worker_id, rid, prompt_tokens=isl,
                            prefill_tokens=isl - decision.overlap_blocks * decode.block_size, now_ms=now_ms)
        await send(decode.queue_topic, decode.queue_partition, key, encode(routed))
        return
    prefill = table.workers[decision.prefill_worker_id]
    stage = PrefillStage(decode_worker_id=decode.worker_id, decode_queue_topic=decode.queue_topic,
                         decode_queue_partition=decode.queue_partition)
    routed = request.model_copy(update={"routing": decision, "disaggregated_params": stage.to_params()})
    note_routed_request(table, prefill.worker_id, rid, prompt_tokens=isl, prefill_tokens=isl, now_ms=now_ms)
    note_routed_request(table, decode.worker_id, rid, prompt_tokens=isl, prefill_tokens=0, now_ms=now_ms)
    await send(prefill.queue_topic, prefill.queue_partition, key, encode(routed))


async def route_and_forward(policy: str, request: InferenceRequest, req: RouteRequest, table: RoutingTable,
                            config: DisaggConfig, send: Send, *, router_id: str = "",
                            now_ms: int = 0) -> Placement:
    """:func:`place`, stamp the decision with ``router_id``/``now_ms``, then :func:`forward`.

    This is the router's whole per-request routing step for every pool
    layout: with no prefill worker it routes exactly as before (decode or
    aggregated worker, local prefill).

    Raises:
        kvflow.router.policies.NoWorkerAvailable: no decode or aggregated worker serves the model.
    """
    placement = place(policy, req, table, config)
    placement = dataclasses.replace(
        placement, decision=placement.decision.model_copy(update={"router_id": router_id, "decided_ms": now_ms}))
    await forward(request, placement, table, send, now_ms=now_ms)
    return placement
