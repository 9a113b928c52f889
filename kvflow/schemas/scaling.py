"""Records on the scaling topic: the planner's replica targets."""

from __future__ import annotations

from pydantic import Field

from kvflow.schemas.base import Record
from kvflow.schemas.workers import WorkerRole

__all__ = ["ScalingCommand"]


class ScalingCommand(Record):
    """Set ``pool`` to ``target_replicas`` workers. ``decision_id`` is unique per
    planner decision; connectors apply each id at most once."""

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
