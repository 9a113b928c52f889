"""Session affinity: requests of one session prefer the worker that served the last one.

A conversation's turns share a growing prefix, and an agent's calls share
tool state; the worker that served the previous turn holds that KV even
when the router's index has not folded its events yet. :class:`SessionTable`
remembers, per session id, the decode worker of the session's latest routed
request (least recently used sessions forgotten past ``capacity``);
:func:`prefer_session_worker` moves a routing decision to that worker when
the policy scored it within a margin of the worker it chose:

    sticky_score <= best_score + margin · max(best_score, 1)

where a score is the candidate's policy cost (KV blocks for ``kv`` and
``approx``, requests for ``least_loaded``) or, for policies that score
nothing (``round_robin``, ``random``), its in-flight requests. The margin
is relative so one setting fits every policy; ``max(…, 1)`` lets an idle
sticky worker win over an idle best one.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from kvflow.schemas import CandidateCost, RoutingDecision

__all__ = ["DEFAULT_SESSION_MARGIN", "SessionTable", "prefer_session_worker"]

DEFAULT_SESSION_MARGIN = 0.25
"""Default relative margin: the session's worker keeps it while its score is
at most 25% (or 0.25 cost units when idle) above the best (kvflow's choice: a
quarter of a prompt's uncached blocks is about what a turn's retained prefix
saves on a multi-turn chat)."""


@dataclass
class SessionTable:
    """Session id → the decode worker of its latest routed request, LRU-bounded.

    Args:
        capacity: most sessions remembered (>= 1). Defaults to ``65536``.

    Raises:
        ValueError: ``capacity < 1``.
    """

    capacity: int = 65_536
    _workers: OrderedDict[str, str] = field(init=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")

    def get(self, session_id: str) -> str | None:
        """The worker of the session's latest routed request, or None."""
        return self._workers.get(session_id)

    def note(self, session_id: str, worker_id: str) -> None:
        """The session's latest request went to ``worker_id``."""
        workers = self._workers
        workers[session_id] = worker_id
        workers.move_to_end(session_id)
        if len(workers) > self.capacity:
            workers.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        """Drop the sessions of a worker that left (O(sessions); workers leave rarely)."""
        for sid in [s for s, w in self._workers.items() if w == worker_id]:
            del self._workers[sid]

    def __len__(self) -> int:
        return len(self._workers)


def _score(c: CandidateCost) -> float:
    if c.cost is not None:
        return c.cost
    return float(c.load or 0)


def prefer_session_worker(decision: RoutingDecision, sticky_id: str, margin: float,
                          allowed: Collection[str]) -> RoutingDecision | None:
    """``decision`` moved to ``sticky_id`` when the policy scored it within
    ``margin`` of the chosen worker (module docstring), else None.

    ``allowed``: worker ids the request may go to (not busy); a sticky
    worker outside it, or one the policy did not weigh, is not preferred.
    The returned decision carries the sticky worker's overlap and cost.
    """
    if sticky_id == decision.worker_id or sticky_id not in allowed:
        return None
    chosen = sticky = None
    for c in decision.candidates:
        if c.worker_id == sticky_id:
            sticky = c
        elif c.worker_id == decision.worker_id:
            chosen = c
    if sticky is None or chosen is None:
        return None
    best = _score(chosen)
    if _score(sticky) > best + margin * max(best, 1.0):
        return None
    return decision.model_copy(update={"worker_id": sticky_id, "overlap_blocks": sticky.overlap_blocks,
                                       "cost": sticky.cost if sticky.cost is not None else decision.cost})
