"""The planner's EPLB job: recompute an MoE model's expert placement and publish it.

Every ``interval_s`` the job reads the model's per-expert load statistics
from a recorded file (:func:`read_expert_loads`: tokens routed per expert
and layer over the last window, as an MoE engine or a metrics export writes
them), computes a placement with :func:`kvflow.planner.eplb.balance`, and
publishes it as an :class:`~kvflow.schemas.ExpertPlacementMap` on the
expert-placement topic (keyed by model, compacted) when the map changed.
Workers that support expert remapping read the latest map of their model.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.planner.eplb import ExpertPlacement, balance
from kvflow.schemas import ExpertPlacementMap, encode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import make_producer

__all__ = ["EplbJob", "placement_record", "read_expert_loads", "run_eplb_job"]

log = logging.getLogger(__name__)


def read_expert_loads(path: str | Path) -> np.ndarray:
    """Per-expert loads ``[layers, experts]`` from a JSON file ``{"load": [[...], ...]}``
    (or a bare list of lists) or a ``.npy`` array.

    Raises:
        OSError: unreadable file. ValueError: not a non-empty 2-D array of numbers >= 0.
    """
    path = Path(path)
    if path.suffix == ".npy":
        data = np.load(path, allow_pickle=False)
    else:
        raw = json.loads(path.read_text(encoding="utf-8"))
        data = np.asarray(raw["load"] if isinstance(raw, dict) else raw, dtype=float)
    data = np.atleast_2d(np.asarray(data, dtype=float))
    if data.ndim != 2 or data.size == 0 or not np.isfinite(data).all() or (data < 0).any():
        raise ValueError(f"{path}: expert loads must be a non-empty [layers, experts] array of numbers >= 0")
    return data


def placement_record(model: str, placement: ExpertPlacement, ts_ms: int) -> ExpertPlacementMap:
    """The topic record of ``placement`` for ``model``."""
    return ExpertPlacementMap(
        model=model, ts_ms=ts_ms, num_gpus=placement.gpu_load.shape[1], slots_per_gpu=placement.slots_per_gpu,
        hierarchical=placement.hierarchical, physical_to_logical=placement.physical_to_logical.tolist(),
        replicas=placement.replicas.tolist(), imbalance=[round(float(x), 6) for x in placement.imbalance])


@dataclass
class EplbJob:
    """What to balance: the model, its load file and the expert-parallel layout
    (as :func:`~kvflow.planner.eplb.balance`); ``interval_s`` between runs."""

    model: str
    loads_path: str
    num_gpus: int
    slots_per_gpu: int
    num_groups: int = 1
    num_nodes: int = 1
    interval_s: float = 60.0

    def compute(self, ts_ms: int) -> ExpertPlacementMap:
        """One placement from the current load file.

        Raises:
            OSError, ValueError: unreadable loads, or a layout that cannot hold them.
        """
        load = read_expert_loads(self.loads_path)
        placement = balance(load, self.num_gpus, self.slots_per_gpu, num_groups=self.num_groups,
                            num_nodes=self.num_nodes)
        return placement_record(self.model, placement, ts_ms)


async def run_eplb_job(settings: Settings, job: EplbJob, *, catalog: Catalog | None = None,
                       stop: asyncio.Event | None = None, once: bool = False) -> int:
    """Recompute and publish ``job``'s placement every ``job.interval_s`` until ``stop``
    is set (or once); a map equal to the last one published is not sent again. A
    load file that cannot be read or balanced is logged and retried next interval.
    Returns the number of maps published."""
    catalog = catalog or Catalog(settings.namespace)
    stop = stop or asyncio.Event()
    producer = make_producer(settings)
    await producer.start()
    published, last = 0, None
    try:
        while True:
            try:
                record = job.compute(now_ms())
            except (OSError, ValueError) as exc:
                log.warning("EPLB for %s skipped: %s", job.model, exc)
            else:
                key = (record.physical_to_logical, record.replicas)
                if key != last:
                    await producer.send_and_wait(catalog.expert_placement.name, encode(record),
                                                 key=job.model.encode())
                    published, last = published + 1, key
                    log.info("EPLB map of %s published: imbalance %s", job.model, record.imbalance)
            if once:
                return published
            try:
                await asyncio.wait_for(stop.wait(), job.interval_s)
                return published
            except asyncio.TimeoutError:
                pass
    finally:
        await producer.stop()
