"""Records on the scaling topic: the planner's replica targets."""

from __future__ import annotations

from pydantic import Field

from kvflow.schemas.base import Record
from kvflow.schemas.workers import WorkerRole

__all__ = ["ScalingCommand"]


class ScalingCommand(Record):
    """Set ``pool`` (the workers of one role) of worker pool ``worker_pool`` to
    ``target_replicas`` workers. ``decision_id`` is unique per planner decision;
    connectors apply each id at most once."""

    decision_id: str
    pool: WorkerRole
    target_replicas: int = Field(ge=0)
    current_replicas: int = Field(ge=0, default=0)
    reason: str = ""
    ts_ms: int
    shadow: bool = False
    """An advisory decision (``kvflow planner --planner-mode shadow``): what the
    planner would do; connectors do not act on it. Added without a schema
    version bump: older readers ignore it, older planners leave it out (False)."""
    worker_pool: str = ""
    """The worker pool (:mod:`kvflow.router.pools`; ``""``: the default pool) whose
    ``pool`` role this sizes: a planner sizing several pools sends one command
    per pool and role. Added without a schema version bump: older planners
    leave it out (the default pool)."""

    @property
    def unit(self) -> tuple[str, WorkerRole]:
        """``(worker_pool, pool)``: what one command sizes; a connector applies
        the commands of each unit in order, latest winning."""
        return self.worker_pool, self.pool
