"""Conditional disaggregation: where a request decodes, and whether its prefill runs elsewhere.

The decision is pure (no I/O, no clock), so the live router, its replicas and
the offline simulator decide identically (both through
:class:`~kvflow.router.core.RouterCore`); :func:`routed_record` builds the
record the live router then sends.

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
from dataclasses import dataclass
from typing import Any, Literal

from kvflow.router.inflight import note_routed_request
from kvflow.router.policies import RouteRequest, select_worker
from kvflow.router.table import RoutingTable, WorkerView
from kvflow.schemas import InferenceRequest, RoutingDecision, WorkerRole
from kvflow.schemas.transfer import PrefillStage

__all__ = [
    "DisaggConfig",
    "PrefillPlan",
    "Placement",
    "decode_role",
    "prefill_queue_depth",
    "decide_prefill",
    "place",
    "count_placement",
    "routed_record",
]

PlanReason = Literal["remote", "short_prompt", "prefill_queue_full", "no_prefill_workers"]


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


def place(policy: str, req: RouteRequest, table: RoutingTable, config: DisaggConfig,
          role: WorkerRole | None = None) -> Placement:
    """Pick the decode worker (decode pool, else aggregated pool), then where to prefill.

    ``role``: the decode pool's role when the caller already knows it
    (:func:`decode_role`), else it is looked up.

    Raises:
        kvflow.router.policies.NoWorkerAvailable: no decode or aggregated worker serves ``req.model``.
        KeyError: unknown ``policy``.
    """
    role = decode_role(table, req.model) if role is None else role
    decision = select_worker(policy, req if req.role is role else dataclasses.replace(req, role=role), table)
    plan = decide_prefill(policy, req, decision, table, config)
    if plan.remote:
        decision = decision.model_copy(update={"prefill_worker_id": plan.prefill.worker_id})
    return Placement(decision, plan)


def count_placement(table: RoutingTable, placement: Placement, request_id: str, isl: int, now_ms: int,
                    max_tokens: int = 0) -> None:
    """Count request ``request_id``, placed by ``placement``, on its workers
    (:func:`~kvflow.router.inflight.note_routed_request` at ``now_ms``, epoch or simulated ms).

    ``isl`` is the prompt length in tokens, ``max_tokens`` its output cap
    (0 = unknown). Work counted: locally, the decode worker computes the
    prompt less its cached overlap; remotely, the prefill worker computes
    the whole prompt (as its admission record will say: the stage does not
    carry the prefill pool's overlap) and decodes nothing, and the decode
    worker computes none of it (it imports the KV). The decode worker
    decodes ``max_tokens``.

    Raises:
        KeyError: a worker of the placement is not in ``table``.
    """
    decision = placement.decision
    decode = table.workers[decision.worker_id]
    if not placement.plan.remote:
        note_routed_request(table, decode.worker_id, request_id, prompt_tokens=isl,
                            prefill_tokens=isl - decision.overlap_blocks * decode.block_size, now_ms=now_ms,
                            max_tokens=max_tokens)
        return
    note_routed_request(table, decision.prefill_worker_id, request_id, prompt_tokens=isl, prefill_tokens=isl,
                        now_ms=now_ms)
    note_routed_request(table, decode.worker_id, request_id, prompt_tokens=isl, prefill_tokens=0, now_ms=now_ms,
                        max_tokens=max_tokens)


def routed_record(request: InferenceRequest, decision: RoutingDecision, decode: WorkerView,
                  remote: bool) -> InferenceRequest:
    """The record a worker queue receives for ``request``: ``decision`` (stamped
    with router id and time) as ``request.routing``.

    Local prefill (``remote`` False): for the decode worker's queue, with
    ``disaggregated_params`` cleared (a client cannot inject a stage).
    Remote: for the prefill worker's queue, with a
    :class:`~kvflow.schemas.transfer.PrefillStage` naming ``decode``'s queue
    partition. One shallow copy of ``request`` (the token ids are shared).
    """
    if not remote:
        return request.model_copy(update={"routing": decision, "disaggregated_params": None})
    stage = PrefillStage(decode_worker_id=decode.worker_id, decode_queue_topic=decode.queue_topic,
                         decode_queue_partition=decode.queue_partition)
    return request.model_copy(update={"routing": decision, "disaggregated_params": stage.to_params()})
