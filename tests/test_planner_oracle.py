"""The planner oracle's schedules (bench/planner_oracle.py) on hand-made miss curves."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "planner_oracle", Path(__file__).resolve().parents[1] / "bench" / "planner_oracle.py")
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

# misses with 1, 2, 3 workers; 100 requests in each window
CURVES = [[40, 3, 0], [30, 1, 0], [9, 0]]
REQUESTS = [100, 100, 100]


def test_per_window_keeps_each_window_within_its_share():
    # 1% of 100 = 1 miss per window: 3 workers, 2 workers, 2 workers
    assert oracle.per_window_schedule(CURVES, REQUESTS, 0.99) == [3, 2, 2]
    # 10% per window: one worker is enough for the third window only
    assert oracle.per_window_schedule(CURVES, REQUESTS, 0.90) == [2, 2, 1]


def test_per_window_takes_the_fewest_miss_pool_when_none_fits():
    assert oracle.per_window_schedule([[50, 20, 20]], [100], 0.99) == [2]


def test_cheapest_schedule_spends_the_budget_where_a_worker_costs_fewest_misses():
    # from the fewest-miss pools [3, 3, 2] (0 misses), removals cost: window 1
    # 3->2: 1 miss, window 0 3->2: 3, window 2 2->1: 9, window 1 2->1: 29.
    # Budget 3: only the first fits (a second would make 4).
    assert oracle.cheapest_schedule(CURVES, 3) == [3, 2, 2]
    # Budget 13 = 1 + 3 + 9: the three cheapest, never the 29-miss one.
    assert oracle.cheapest_schedule(CURVES, 13) == [2, 2, 1]
    # Budget 12: window 2's 9 no longer fits after the other two.
    assert oracle.cheapest_schedule(CURVES, 12) == [2, 2, 2]


@pytest.mark.parametrize("pools, hours", [([2, 2, 1], (2 * 60 + 2 * 60 + 1 * 30) / 3600)])
def test_schedule_hours_counts_the_last_window_up_to_the_trace_end(pools, hours):
    assert oracle.schedule_hours(pools, 60_000.0, 150_000.0) == pytest.approx(hours)


def test_the_pool_search_stops_at_a_plateau_only_once_most_requests_meet_the_sla():
    assert oracle.search_done([5, 0], 100)
    assert oracle.search_done([40, 3, 3], 100)  # a worker more lowered nothing: some prompts miss on any pool
    assert not oracle.search_done([40, 3], 100)
    # 3 and 4 workers both swamped by a burst: more workers may still meet it
    assert not oracle.search_done([662, 662, 658, 658], 662)
    assert not oracle.search_done([100, 100], 100)
