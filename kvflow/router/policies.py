"""Routing policies: pure functions of (request, routing state) → worker.

A policy receives the :class:`RouteRequest`, the candidate workers (serving
workers of the request's model and pool, sorted by id) and the
:class:`~kvflow.router.table.RoutingTable`, and returns a
:class:`~kvflow.schemas.RoutingDecision`. Policies never do I/O and never read
the clock; any randomness is seeded from the request id, so every router
replica and the offline simulator decide identically for the same inputs.

A decision lists every candidate the policy weighed with the terms it used
(``RoutingDecision.candidates``, :class:`~kvflow.schemas.CandidateCost`),
for the router's routing-decisions record: the KV-aware policies give
their cost terms (:func:`kvflow.router.kv_policy.worker_terms`), the
others each worker's in-flight load (and ``least_loaded`` its cost).
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvflow.router.table import RoutingTable, WorkerView
from kvflow.schemas import CandidateCost, RoutingDecision, WorkerRole

__all__ = ["RouteRequest", "Policy", "POLICIES", "HASH_FREE_POLICIES", "register_policy", "select_worker",
           "NoWorkerAvailable", "load_terms"]


class NoWorkerAvailable(LookupError):
    """No serving worker of the request's model and pool exists."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at. ``isl`` in tokens; ``block_hashes`` are the
    prompt's chained block hashes, any sequence of u64 ints (empty when the
    policy does not need them, see :data:`HASH_FREE_POLICIES`);
    ``now_ms`` is the decision time (epoch or simulated ms), passed in so
    policies never read a clock."""

    request_id: str
    model: str
    isl: int
    role: WorkerRole = WorkerRole.aggregated
    block_hashes: Sequence[int] = ()
    lora_name: str | None = None
    now_ms: int = 0


Policy = Callable[[RouteRequest, list[WorkerView], RoutingTable], RoutingDecision]

POLICIES: dict[str, Policy] = {}

HASH_FREE_POLICIES = frozenset({"round_robin", "random", "least_loaded"})
"""Policies that never read ``RouteRequest.block_hashes``: the router skips hashing the prompt for them."""


def register_policy(name: str) -> Callable[[Policy], Policy]:
    """Decorator adding a policy to :data:`POLICIES` under ``name``."""

    def deco(fn: Policy) -> Policy:
        POLICIES[name] = fn
        return fn

    return deco


def request_rng(request_id: str) -> _random.Random:
    """A random generator seeded from the request id (xxh3-64), identical on every replica."""
    return _random.Random(xxhash.xxh3_64_intdigest(request_id.encode()))


def load_terms(candidates: list[WorkerView], *, scored: bool = False) -> tuple[CandidateCost, ...]:
    """Each candidate's in-flight load (:attr:`WorkerView.load`, requests), same order;
    ``scored``: the load is also the cost (``least_loaded``), else the cost is None."""
    return tuple(CandidateCost(worker_id=w.worker_id, load=w.load, cost=float(w.load) if scored else None)
                 for w in candidates)


@register_policy("round_robin")
def round_robin(req: RouteRequest, candidates: list[WorkerView], table: RoutingTable) -> RoutingDecision:
    """Cycle through candidates in worker-id order; the cursor lives in the table."""
    key = (req.model, req.role.value)
    cursor = table.rr_cursor.get(key, 0)
    worker = candidates[cursor % len(candidates)]
    table.rr_cursor[key] = cursor + 1
    return RoutingDecision(worker_id=worker.worker_id, policy="round_robin", candidates=load_terms(candidates))


@register_policy("random")
def random_policy(req: RouteRequest, candidates: list[WorkerView], table: RoutingTable) -> RoutingDecision:
    """Uniform choice, seeded by the request id."""
    worker = request_rng(req.request_id).choice(candidates)
    return RoutingDecision(worker_id=worker.worker_id, policy="random", candidates=load_terms(candidates))


@register_policy("least_loaded")
def least_loaded(req: RouteRequest, candidates: list[WorkerView], table: RoutingTable) -> RoutingDecision:
    """Fewest in-flight requests (:attr:`WorkerView.load`); ties go to the lowest id."""
    worker = min(candidates, key=lambda w: (w.load, w.worker_id))
    return RoutingDecision(worker_id=worker.worker_id, policy="least_loaded", cost=float(worker.load),
                           candidates=load_terms(candidates, scored=True))


def select_worker(policy: str, req: RouteRequest, table: RoutingTable) -> RoutingDecision:
    """Pick a worker for ``req`` with the named policy.

    Raises:
        KeyError: unknown policy name.
        NoWorkerAvailable: no serving worker of ``req.model`` in pool ``req.role``.
    """
    fn = POLICIES[policy]
    candidates = table.candidates(req.model, req.role)
    if not candidates:
        raise NoWorkerAvailable(f"no {req.role.value} worker serves model {req.model!r}")
    return fn(req, candidates, table)


# KV-aware policies register themselves on import (kept last: they import this module).
from kvflow.router import kv_policy as _kv_policy  # noqa: E402,F401
