"""When a worker heartbeats: on wall-clock boundaries shared by every worker.

A worker ticks on whole multiples of ``heartbeat_interval_ms`` of the wall
clock (Unix time), and an idle worker whose state has not changed beats only
on the tick that crosses a whole multiple of its idle period. So the idle
heartbeats of all the workers of a host (and of hosts whose clocks agree)
land within milliseconds of each other instead of at phases set by when each
worker started.

Why: every reader of the workers topic (router projections, the router's
dead-letter check, each bridge's worker registry) has a fetch parked on the
embedded broker, which answers it once a record arrives; each answer is a
wake-up of the reader and a fetch request more for the broker. Four idle
workers beating at their own phases every 5 s woke each reader 0.8 times a
second; beating together, 0.2 times. Liveness is unchanged: the gap between
two idle beats is still at most the idle period (plus the loop's lateness),
which the idle heartbeat's longer TTL covers.

An idle worker also need not wake at every tick to find that nothing
changed: :func:`next_idle_beat_tick` names the tick of its next idle beat, and
the worker sleeps until then unless work (or an unscheduled beat) wakes it.
"""

from __future__ import annotations

import math

__all__ = ["next_tick", "tick_time", "wait_for_tick", "idle_beat_due", "next_idle_beat_tick"]

_EPS = 1e-9


def next_tick(now_s: float, interval_s: float) -> int:
    """Index ``k`` of the first tick strictly after ``now_s``: tick ``k`` is at
    ``k · interval_s`` seconds of Unix time.

    Raises:
        ValueError: ``interval_s`` <= 0.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    return math.floor(now_s / interval_s + _EPS) + 1


def tick_time(tick: int, interval_s: float) -> float:
    """Unix time (s) of tick ``tick``."""
    return tick * interval_s


def wait_for_tick(tick: int, interval_s: float, now_s: float) -> tuple[int, float]:
    """``(tick, seconds to sleep)`` until tick ``tick``, at most ``interval_s``.

    A tick more than ``interval_s`` ahead means the wall clock went back
    (e.g. stepped by NTP): the tick is re-based on ``now_s`` so the worker
    never sleeps through its beats. A tick already past gives 0.
    """
    delay = tick_time(tick, interval_s) - now_s
    if delay > interval_s:
        tick = next_tick(now_s, interval_s)
        delay = tick_time(tick, interval_s) - now_s
    return tick, min(max(delay, 0.0), interval_s)


def idle_beat_due(last_beat_s: float, tick_s: float, idle_period_s: float) -> bool:
    """Whether an idle, unchanged worker beats at the tick at ``tick_s``: when a
    whole multiple of ``idle_period_s`` lies in (``last_beat_s``, ``tick_s``]
    (both Unix seconds of ticks), or when ``tick_s`` is before ``last_beat_s``
    (the wall clock went back). A busy or changed worker beats at every tick.

    Raises:
        ValueError: ``idle_period_s`` <= 0.
    """
    if idle_period_s <= 0:
        raise ValueError(f"idle_period_s must be > 0, got {idle_period_s}")
    if tick_s < last_beat_s:
        return True
    return math.floor(tick_s / idle_period_s + _EPS) > math.floor(last_beat_s / idle_period_s + _EPS)


def next_idle_beat_tick(last_beat_s: float, interval_s: float, idle_period_s: float) -> int:
    """Index of the first tick (``interval_s`` grid) at which
    :func:`idle_beat_due` holds for a worker that last beat at ``last_beat_s``:
    the first tick at or after the next whole multiple of ``idle_period_s``.

    Raises:
        ValueError: ``interval_s`` or ``idle_period_s`` <= 0.
    """
    if interval_s <= 0 or idle_period_s <= 0:
        raise ValueError(f"interval_s and idle_period_s must be > 0, got {interval_s}, {idle_period_s}")
    boundary = (math.floor(last_beat_s / idle_period_s + _EPS) + 1) * idle_period_s
    return math.ceil(boundary / interval_s - _EPS)
