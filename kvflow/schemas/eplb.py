"""Records on the expert-placement topic: where an MoE model's experts go (EPLB)."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvflow.schemas.base import Record

__all__ = ["ExpertPlacementMap"]


class ExpertPlacementMap(Record):
    """The planner's expert placement for one model (keyed by model; the latest wins).

    GPU ``g`` of the expert-parallel group hosts, in MoE layer ``l``, the
    logical experts ``physical_to_logical[l][g * slots_per_gpu:(g + 1) * slots_per_gpu]``
    (``[layers][num_gpus * slots_per_gpu]``); ``replicas[l][e]`` counts the
    copies of logical expert ``e`` (``[layers][experts]``, each >= 1) and
    ``imbalance[l]`` is the expected max / mean GPU load after balancing.
    ``hierarchical``: expert groups were kept whole per node. ``ts_ms``:
    when it was computed, epoch ms. Workers that apply placements load it
    and remap their experts; others ignore it.
    """

    model: str = Field(min_length=1)
    ts_ms: int = Field(ge=0)
    num_gpus: int = Field(ge=1)
    slots_per_gpu: int = Field(ge=1)
    hierarchical: bool = False
    physical_to_logical: list[list[int]]
    replicas: list[list[int]]
    imbalance: list[float]

    @model_validator(mode="after")
    def _shapes(self) -> "ExpertPlacementMap":
        slots = self.num_gpus * self.slots_per_gpu
        if not (len(self.physical_to_logical) == len(self.replicas) == len(self.imbalance)):
            raise ValueError("physical_to_logical, replicas and imbalance need one entry per layer")
        for phy, reps in zip(self.physical_to_logical, self.replicas):
            if len(phy) != slots or sum(reps) != slots or min(reps, default=1) < 1:
                raise ValueError(f"each layer needs {slots} slots and replica counts >= 1 summing to them")
            if any(not 0 <= e < len(reps) for e in phy):
                raise ValueError("a physical slot names an unknown logical expert")
        return self
