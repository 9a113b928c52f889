"""Heartbeat ticks on shared wall-clock boundaries (kvflow.workers.heartbeat_clock)."""

from __future__ import annotations

import pytest

from kvflow.workers.heartbeat_clock import idle_beat_due, next_idle_beat_tick, next_tick, tick_time, wait_for_tick


def test_ticks_are_whole_multiples_of_the_interval():
    assert next_tick(1000.2, 1.0) == 1001 and tick_time(1001, 1.0) == 1001.0
    assert next_tick(1000.0, 1.0) == 1001  # strictly after
    assert tick_time(next_tick(7.3, 0.5), 0.5) == 7.5
    with pytest.raises(ValueError):
        next_tick(1.0, 0)


def test_workers_started_apart_beat_idle_on_the_same_ticks():
    interval, idle = 1.0, 5.0
    beats = {}
    for worker, started in (("a", 100.3), ("b", 101.7), ("c", 103.9)):
        tick, last, seen = next_tick(started, interval), started, []
        while tick_time(tick, interval) <= 130:
            at = tick_time(tick, interval)
            if idle_beat_due(last, at, idle):
                seen.append(at)
                last = at
            tick += 1
        beats[worker] = seen
    assert beats["a"] == beats["b"] == beats["c"] == [105.0, 110.0, 115.0, 120.0, 125.0, 130.0]
    for seen in beats.values():  # no gap between idle beats exceeds the idle period
        assert all(b - a <= idle for a, b in zip(seen, seen[1:]))


def test_a_late_or_stepped_clock_never_stalls_the_beats():
    assert wait_for_tick(11, 1.0, 10.25) == (11, 0.75)
    assert wait_for_tick(11, 1.0, 12.5) == (11, 0.0)  # late: beat now
    tick, delay = wait_for_tick(5000, 1.0, 10.25)  # the clock went back an hour: re-based
    assert tick == 11 and delay == pytest.approx(0.75)
    assert idle_beat_due(last_beat_s=5000.0, tick_s=11.0, idle_period_s=5.0)  # ... and the idle beat is due
    with pytest.raises(ValueError):
        idle_beat_due(0.0, 1.0, 0.0)


@pytest.mark.parametrize(("interval", "idle"), [(1.0, 5.0), (0.5, 5.0), (1.0, 2.5), (0.3, 1.0), (2.0, 2.0)])
def test_the_parked_worker_wakes_on_the_tick_of_its_next_idle_beat(interval, idle):
    # Stepping tick by tick with idle_beat_due and jumping with next_idle_beat_tick agree.
    for last_tick in range(40, 80):
        last = tick_time(last_tick, interval)
        tick = last_tick + 1
        while not idle_beat_due(last, tick_time(tick, interval), idle):
            tick += 1
        assert next_idle_beat_tick(last, interval, idle) == tick
    assert next_idle_beat_tick(103.9, 1.0, 5.0) == 105  # a beat between ticks (start-up)
    with pytest.raises(ValueError):
        next_idle_beat_tick(1.0, 1.0, 0.0)
