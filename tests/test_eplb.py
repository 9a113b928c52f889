"""EPLB: replicas and placement of MoE experts balance the GPUs' loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvflow.planner.eplb import balance, contiguous_imbalance, imbalance


def zipf_loads(layers: int, experts: int, s: float = 1.2, seed: int = 0) -> np.ndarray:
    """Skewed per-expert loads: Zipf weights over a random expert order per layer, tokens counted."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** s
    out = np.empty((layers, experts))
    for layer in range(layers):
        out[layer] = rng.multinomial(1_000_000, weights / weights.sum())[rng.permutation(experts)]
    return out


def check(placement, load: np.ndarray) -> None:
    """Every logical expert placed as often as its replica count; GPU loads add up to the layer load."""
    layers, experts = load.shape
    for layer in range(layers):
        placed = np.bincount(placement.physical_to_logical[layer], minlength=experts)
        assert (placed == placement.replicas[layer]).all() and (placed >= 1).all()
        assert placement.gpu_load[layer].sum() == pytest.approx(load[layer].sum())


@pytest.mark.parametrize("spare_per_gpu", [2, 4])
def test_global_balancing_brings_a_skewed_load_under_1_1(spare_per_gpu):
    load = zipf_loads(4, 64)
    before = contiguous_imbalance(load, 8)
    p = balance(load, num_gpus=8, slots_per_gpu=8 + spare_per_gpu)
    check(p, load)
    assert (before > 1.5).all() and (p.imbalance <= 1.1).all()
    assert not p.hierarchical


def test_hierarchical_keeps_each_group_on_one_node():
    load = zipf_loads(2, 64, seed=3)
    p = balance(load, num_gpus=8, slots_per_gpu=10, num_groups=8, num_nodes=2)
    check(p, load)
    # Whole groups per node cap how well nodes can be evened out (no replica crosses a node):
    # looser than global balancing, still far below the unbalanced placement.
    assert p.hierarchical and (p.imbalance <= 1.25).all() and (p.imbalance < contiguous_imbalance(load, 8)).all()
    for layer in range(2):
        for node in range(2):
            hosted = {e for g in range(node * 4, node * 4 + 4) for e in p.gpu_experts(layer, g)}
            groups = {e // 8 for e in hosted}
            assert len(groups) == 4  # four whole groups of eight experts per node
            assert hosted == {e for grp in groups for e in range(grp * 8, grp * 8 + 8)}


def test_groups_that_do_not_divide_fall_back_to_global():
    load = zipf_loads(1, 60, seed=1)
    p = balance(load, num_gpus=6, slots_per_gpu=12, num_groups=5, num_nodes=2)
    check(p, load)
    assert not p.hierarchical and p.imbalance[0] <= 1.1


def test_map_format_round_trips_and_bad_input_is_refused():
    load = zipf_loads(1, 16)
    p = balance(load, num_gpus=4, slots_per_gpu=5)
    doc = json.loads(p.to_json())
    assert doc["num_gpus"] == 4 and doc["slots_per_gpu"] == 5 and len(doc["physical_to_logical"][0]) == 20
    assert sum(doc["replicas"][0]) == 20 and doc["imbalance"][0] == pytest.approx(float(p.imbalance[0]), abs=1e-6)
    assert imbalance(np.zeros((1, 4)))[0] == 1.0
    with pytest.raises(ValueError):
        balance(load, num_gpus=2, slots_per_gpu=4)  # 8 slots for 16 experts
    with pytest.raises(ValueError):
        balance(-load, num_gpus=4, slots_per_gpu=5)
