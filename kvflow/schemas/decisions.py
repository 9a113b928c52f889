"""Records on the routing-decisions topic: what the router decided for each request, and why.

The router publishes one :class:`DecisionRecord` per decision it takes on a
request (keyed by request id, so every record of one request lands in one
partition, in order): the candidates it weighed with the terms of the
policy's cost, the worker it chose, or that it shed or queued the request.
A request held in the router's queue has two records: ``queued``, then
``routed`` (or ``shed``) when it leaves the queue. Nothing in the pipeline
reads the topic; ``kvflow explain REQUEST_ID`` does.

Records are compact: no prompt, no token ids; one :class:`CandidateCost`
per candidate worker, with only the terms its policy uses (unset terms are
left out of the JSON). Units: blocks are KV blocks of the worker's
``block_size`` tokens; ``isl`` is in tokens; times are epoch ms.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

from kvflow.schemas.base import Record
from kvflow.schemas.workers import WorkerRole

__all__ = ["CandidateCost", "DecisionOutcome", "DecisionRecord"]


class CandidateCost(BaseModel):
    """One candidate worker of a routing decision and the policy's terms for it.

    ``kv`` and ``approx`` fill the cost terms of
    :func:`kvflow.router.kv_policy.worker_costs`::

        cost = prefill_load_scale · (prefill_blocks + queue_weight · queued_prefill_blocks)
               + decode_weight · decode_requests
               + stall_weight · prefill_blocks · stall_exposure

    Attributes:
        worker_id: the candidate.
        overlap_blocks: prompt blocks cached in the worker's device memory
            (0 for policies that do not look at the KV cache).
        host_overlap_blocks: prompt blocks cached in host memory (None: none
            of the candidates reported a host or disk tier).
        disk_overlap_blocks: prompt blocks cached on disk (None as above).
        prefill_blocks: the request's own prefill on this worker after the
            cache credit, in blocks (≥ 0).
        queued_prefill_blocks: prompt work already waiting on the worker,
            in blocks (its heartbeat's prefill tokens plus the requests
            routed to it since).
        decode_requests: requests running on the worker (reported active
            plus routed since its heartbeat).
        stall_exposure: Σ ``1 / (max_tokens − 1)`` over the requests the
            worker holds: the mean inter-token latency (ms) a prefill of
            1 ms there adds to them in all (None for policies that do not
            weigh it).
        load: requests in flight on the worker (active + waiting + routed
            since its heartbeat): the ``least_loaded`` cost, and what
            ``round_robin`` and ``random`` saw without using it.
        cost: the policy's score (lower is better; KV blocks for ``kv`` and
            ``approx``, requests for ``least_loaded``); None for policies
            that score nothing (``round_robin``, ``random``).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    worker_id: str
    overlap_blocks: int = 0
    host_overlap_blocks: int | None = None
    disk_overlap_blocks: int | None = None
    prefill_blocks: float | None = None
    queued_prefill_blocks: float | None = None
    decode_requests: int | None = None
    stall_exposure: float | None = None
    load: int | None = None
    cost: float | None = None


class DecisionOutcome(str, Enum):
    """What the router did with a request.

    ``routed``: sent to a worker's queue. ``queued``: held in the router's
    queue until a worker is free (a later record tells the rest).
    ``shed``: answered 503, every worker busy (or the queue full).
    ``rejected``: answered 503, no worker serves the model.
    """

    routed = "routed"
    queued = "queued"
    shed = "shed"
    rejected = "rejected"


class DecisionRecord(Record):
    """One routing decision of the router (a record of the routing-decisions topic, keyed by request id).

    Attributes:
        request_id: the request decided on.
        model: its model.
        outcome: routed, queued, shed or rejected (:class:`DecisionOutcome`).
        policy: the routing policy's name.
        router_id: the router replica that decided.
        decided_ms: when, epoch ms.
        isl: prompt tokens (0 when the request was not tokenized).
        role: the pool the worker was chosen from (``aggregated`` or ``decode``).
        worker_id: the chosen worker (None unless routed).
        prefill_worker_id: the worker chosen to prefill remotely
            (disaggregated serving), else None.
        prefill_reason: why the prefill is remote or local (the disaggregation
            rule's clause: ``remote``, ``short_prompt``, ``prefill_queue_full``);
            None unless routed while prefill workers serve the model.
        reason: why a request was shed, queued or rejected; None when routed.
        candidates: the workers the policy weighed, in worker-id order.
        prefill_candidates: the prefill workers weighed for a remote prefill.
        priority: the request's priority class (higher is served first).
        tenant: who sent it (a digest of the API key), None when unknown.
        session_hit: routed to its session's worker rather than the policy's
            choice (the session's worker scored within the affinity margin).
        prefill_pool: the pool the global router's grid picked for the
            prompt (remote prefill); None without a pool grid.
        decode_pool: the pool picked for decoding (or the whole request);
            None without a pool grid, or when that pool had no worker and
            every pool was considered.
    """

    request_id: str = Field(min_length=1)
    model: str
    outcome: DecisionOutcome
    policy: str
    router_id: str = ""
    decided_ms: int = Field(ge=0)
    isl: int = Field(ge=0, default=0)
    role: WorkerRole = WorkerRole.aggregated
    worker_id: str | None = None
    prefill_worker_id: str | None = None
    prefill_reason: str | None = None
    reason: str | None = None
    candidates: list[CandidateCost] = Field(default_factory=list)
    prefill_candidates: list[CandidateCost] = Field(default_factory=list)
    priority: int = 0
    tenant: str | None = None
    session_hit: bool = False
    prefill_pool: str | None = None
    decode_pool: str | None = None
