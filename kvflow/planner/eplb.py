"""Expert-parallel load balancing (EPLB): where to put an MoE model's experts, and how many copies.

In expert parallelism each GPU hosts ``slots_per_gpu`` physical experts, so a
deployment has ``num_gpus · slots_per_gpu`` physical slots for ``E``
logical experts per MoE layer (``slots >= E``; the surplus holds replicas
of hot experts). Tokens routed to a replicated expert are split evenly over
its replicas, so a GPU's load is the sum, over the physical experts it
hosts, of ``load[logical] / replicas[logical]``. Given per-expert load
statistics (tokens routed to each expert over a window, from a metrics
stream or a recorded file), :func:`balance` computes, per layer:

1. **replication**: every expert gets one replica; each spare slot goes to
   the expert with the highest load per replica (largest-remainder greedy,
   which minimises the largest per-replica load for a given slot count);
2. **packing**: replicas, heaviest first, go to the GPU with the least load
   that still has a free slot (longest-processing-time first under a slot
   limit; Graham, "Bounds on multiprocessing timing anomalies", 1969, for
   the unconstrained case), never two replicas of one expert on one GPU
   when another GPU has room.

**Hierarchical** balancing (when ``num_nodes`` > 1 divides the number of
expert groups ``num_groups``, and the GPUs split evenly over nodes): whole
expert groups are first packed onto nodes, ``num_groups / num_nodes`` per
node, balancing the nodes' loads (so the tokens of a group, which the
router sends together under group-limited routing, stay inside one node);
replication and packing then run within each node over its own slots.
Otherwise the balancing is **global**: all experts over all GPUs.

The map (:class:`ExpertPlacement`, JSON via :meth:`ExpertPlacement.to_json`)::

    {
      "num_layers": 2, "num_logical_experts": 64, "num_gpus": 8, "slots_per_gpu": 10,
      "physical_to_logical": [[...80 ints...], [...]],   # [layer][gpu * slots_per_gpu + slot] -> logical expert
      "replicas": [[...64 ints...], [...]],               # [layer][logical expert] -> copies (>= 1)
      "gpu_load": [[...8 floats...], [...]],              # [layer][gpu] -> expected load after balancing
      "imbalance": [1.02, 1.04]                           # [layer] max / mean GPU load
    }

GPU ``g`` hosts ``physical_to_logical[layer][g*S:(g+1)*S]`` for ``S =
slots_per_gpu``. Pure functions on numpy arrays; no I/O, no clock.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass

import numpy as np

__all__ = ["ExpertPlacement", "balance", "contiguous_imbalance", "imbalance"]


@dataclass(frozen=True)
class ExpertPlacement:
    """A balanced placement (module docstring for the field shapes).

    Attributes:
        physical_to_logical: ``[layers, num_gpus * slots_per_gpu]`` int array.
        replicas: ``[layers, num_logical_experts]`` int array.
        gpu_load: ``[layers, num_gpus]`` float array, expected load per GPU.
        slots_per_gpu: physical experts per GPU.
        hierarchical: whether groups were packed onto nodes first.
    """

    physical_to_logical: np.ndarray
    replicas: np.ndarray
    gpu_load: np.ndarray
    slots_per_gpu: int
    hierarchical: bool

    @property
    def imbalance(self) -> np.ndarray:
        """Per layer: max / mean GPU load (1.0 = perfect)."""
        return imbalance(self.gpu_load)

    def gpu_experts(self, layer: int, gpu: int) -> list[int]:
        """The logical experts GPU ``gpu`` hosts in ``layer``, slot order."""
        s = self.slots_per_gpu
        return self.physical_to_logical[layer, gpu * s:(gpu + 1) * s].tolist()

    def to_json(self) -> str:
        """The documented map format (module docstring)."""
        layers, slots = self.physical_to_logical.shape
        return json.dumps({
            "num_layers": layers, "num_logical_experts": self.replicas.shape[1],
            "num_gpus": slots // self.slots_per_gpu, "slots_per_gpu": self.slots_per_gpu,
            "hierarchical": self.hierarchical,
            "physical_to_logical": self.physical_to_logical.tolist(), "replicas": self.replicas.tolist(),
            "gpu_load": np.round(self.gpu_load, 6).tolist(), "imbalance": np.round(self.imbalance, 6).tolist(),
        })


def imbalance(gpu_load: np.ndarray) -> np.ndarray:
    """Max / mean of the last axis (per layer); 1.0 where the mean is 0."""
    load = np.atleast_2d(np.asarray(gpu_load, dtype=float))
    mean = load.mean(axis=-1)
    return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)


def contiguous_imbalance(load: np.ndarray, num_gpus: int) -> np.ndarray:
    """The unbalanced reference: no replicas, experts ``0..E-1`` split into ``num_gpus``
    contiguous equal runs (``E`` divisible by ``num_gpus``); per layer max / mean GPU load.

    Raises:
        ValueError: ``E`` not divisible by ``num_gpus``.
    """
    load = np.atleast_2d(np.asarray(load, dtype=float))
    layers, experts = load.shape
    if experts % num_gpus:
        raise ValueError(f"{experts} experts do not split evenly over {num_gpus} GPUs")
    return imbalance(load.reshape(layers, num_gpus, experts // num_gpus).sum(axis=-1))


def _replicate(load: np.ndarray, slots: int) -> np.ndarray:
    """Copies per expert: one each, then each spare slot to the highest load per copy."""
    counts = np.ones(len(load), dtype=np.int64)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(slots - len(load)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def _pack(items: list[tuple[float, int]], bins: int, capacity: int) -> tuple[list[list[int]], np.ndarray]:
    """Heaviest first to the lightest bin with room (preferring bins without the same id).

    ``items``: (weight, id). Returns the ids per bin and the bins' loads.
    """
    order = sorted(items, key=lambda it: (-it[0], it[1]))
    content: list[list[int]] = [[] for _ in range(bins)]
    loads = np.zeros(bins)
    for weight, ident in order:
        open_bins = [b for b in range(bins) if len(content[b]) < capacity]
        fresh = [b for b in open_bins if ident not in content[b]] or open_bins
        b = min(fresh, key=lambda i: (loads[i], i))
        content[b].append(ident)
        loads[b] += weight
    return content, loads


def _balance_flat(load: np.ndarray, experts: np.ndarray, gpus: int, slots_per_gpu: int
                  ) -> tuple[list[list[int]], np.ndarray, dict[int, int]]:
    """Replicate and pack ``experts`` (logical ids, loads ``load[experts]``) over ``gpus`` GPUs."""
    counts = _replicate(load[experts], gpus * slots_per_gpu)
    items = [(float(load[e]) / c, int(e)) for e, c in zip(experts, counts) for _ in range(c)]
    content, loads = _pack(items, gpus, slots_per_gpu)
    return content, loads, {int(e): int(c) for e, c in zip(experts, counts)}


def balance(load: np.ndarray, num_gpus: int, slots_per_gpu: int, *, num_groups: int = 1,
            num_nodes: int = 1) -> ExpertPlacement:
    """Place the experts of every layer (module docstring).

    Args:
        load: ``[layers, E]`` or ``[E]`` per-expert loads (tokens routed, >= 0).
        num_gpus: GPUs of the expert-parallel group.
        slots_per_gpu: physical experts per GPU; ``num_gpus · slots_per_gpu >= E``.
        num_groups: expert groups (contiguous, ``E / num_groups`` experts each).
        num_nodes: nodes the GPUs are spread over (``num_gpus / num_nodes`` each).

    Raises:
        ValueError: negative loads, too few slots, or groups/nodes that do not divide.
    """
    load = np.atleast_2d(np.asarray(load, dtype=float))
    layers, experts = load.shape
    if (load < 0).any():
        raise ValueError("expert loads must be >= 0")
    if num_gpus < 1 or slots_per_gpu < 1 or num_gpus * slots_per_gpu < experts:
        raise ValueError(f"{num_gpus} GPUs x {slots_per_gpu} slots cannot hold {experts} experts")
    if num_groups < 1 or experts % num_groups:
        raise ValueError(f"{experts} experts do not split into {num_groups} groups")
    hierarchical = (num_nodes > 1 and num_groups % num_nodes == 0 and num_gpus % num_nodes == 0
                    and (num_gpus // num_nodes) * slots_per_gpu >= experts // num_nodes)
    total = num_gpus * slots_per_gpu
    phy = np.zeros((layers, total), dtype=np.int64)
    reps = np.zeros((layers, experts), dtype=np.int64)
    gpu_load = np.zeros((layers, num_gpus))
    per_group = experts // num_groups
    for layer in range(layers):
        w = load[layer]
        if hierarchical:
            group_load = [(float(w[g * per_group:(g + 1) * per_group].sum()), g) for g in range(num_groups)]
            nodes, _ = _pack(group_load, num_nodes, num_groups // num_nodes)
            gpus_per_node = num_gpus // num_nodes
            parts = []
            for node, groups in enumerate(nodes):
                members = np.concatenate([np.arange(g * per_group, (g + 1) * per_group) for g in sorted(groups)])
                parts.append((node * gpus_per_node, _balance_flat(w, members, gpus_per_node, slots_per_gpu)))
        else:
            parts = [(0, _balance_flat(w, np.arange(experts), num_gpus, slots_per_gpu))]
        for first_gpu, (content, loads, counts) in parts:
            for i, hosted in enumerate(content):
                g = first_gpu + i
                phy[layer, g * slots_per_gpu:(g + 1) * slots_per_gpu] = hosted
                gpu_load[layer, g] = loads[i]
            for e, c in counts.items():
                reps[layer, e] = c
    return ExpertPlacement(phy, reps, gpu_load, slots_per_gpu, hierarchical)
