"""When the live mocker computes its steps and hands their outputs over.

The plain live mocker wakes once per step: compute it, sleep its modelled
duration, deliver its tokens. On a host where every wake-up of a Python
process is dear (docs/benchmarks.md, "Idle wake-ups"), that is most of a
mocker worker's CPU, although its worker holds the tokens back for a whole
delta flush period (``stream_flush_ms``) anyway.

:class:`StepDelivery` lets the engine wake for what a client must see on
time instead:

- the end of a step that emits a request's first token or finishes one;
- an arrival or an abort (the engine calls :meth:`StepDelivery.add` /
  :meth:`StepDelivery.abort`);
- otherwise the next tick of a clock ticking every ``interval_s`` while
  outputs wait, so the rest reach the worker at most one interval late.

Steps are still computed one at a time, each only once the wall clock has
reached its start, so the core never runs ahead of an arrival: an arrival
first computes every step that started before it, and the request joins the
step it would join on the plain engine. A step not computed yet can emit a
first token or a finish only after
:meth:`~kvflow.workers.engines.mocker_core.MockerCore.quiet_steps` steps,
each at least :func:`~kvflow.workers.engines.mocker_core.min_step_ms` long,
so :meth:`StepDelivery.next_wake` is never later than the start of the first
step that may. The outputs of one request that wait together are merged into
one :class:`~kvflow.workers.engines.base.EngineOutput` (all their tokens, the
last one's finish reason). Steps follow each other on their own clock (each
starts where the previous one ended): a late event loop delays delivery, not
the steps, as a GPU's engine would not wait for a busy host either.

While a request with stop strings runs, every step is delivered at its end:
its worker aborts it as soon as the text matches, which frees its batch slot.

Times are :func:`time.monotonic` seconds; the class has no clock of its own,
so tests drive it with any times.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvflow.schemas import KvEvent
from kvflow.workers.engines.base import EngineOutput, GenerateRequest
from kvflow.workers.engines.mocker_core import MockerCore, StepResult, min_step_ms

__all__ = ["StepDelivery", "EARLY_S"]

EARLY_S = 0.0005
"""A step ending this soon after ``now`` is delivered now: timers fire up to a
millisecond early (uvloop counts in ms), and a second wake-up for the rest
costs more than half a millisecond of lead."""


@dataclass
class _Held:
    end_s: float
    step: StepResult
    urgent: bool  # holds a first token or a finish: delivered at its end


@dataclass
class StepDelivery:
    """The step and delivery schedule of one live mocker (module docstring).

    Args:
        core: the engine's core; this class is the only one to step it.
        interval_s: the tick period of outputs that are not due at once (> 0).

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    core: MockerCore
    interval_s: float
    _held: deque[_Held] = field(default_factory=deque)
    _next_start: float | None = None  # start of the next step; None: idle or stalled
    _stalled: bool = False  # nothing could be scheduled: wait for an arrival or an abort
    _fresh: set[str] = field(default_factory=set)  # requests without a first token yet
    _stops: set[str] = field(default_factory=set)  # requests with stop strings

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        self._min_step_s = min_step_ms(self.core.config) / 1000.0

    def add(self, request: GenerateRequest, now: float, *, kv_imported: bool = False
            ) -> tuple[dict[str, EngineOutput], list[KvEvent]]:
        """Catch up to ``now``, then queue ``request`` in the core.

        Returns what :meth:`advance` delivered while catching up.

        Raises:
            EngineError: the core rejects the request (nothing is queued).
        """
        delivered = self.advance(now)
        self.core.add_request(request, kv_imported=kv_imported)
        self._resume(now)
        self._fresh.add(request.request_id)
        if request.sampling.stop:
            self._stops.add(request.request_id)
        return delivered

    def abort(self, request_id: str, now: float) -> tuple[dict[str, EngineOutput], list[KvEvent]]:
        """Catch up to ``now``, then drop ``request_id`` from the core (no-op if unknown).

        Returns what :meth:`advance` delivered while catching up; the caller
        drops any output of ``request_id`` still held (its queue is gone).
        """
        delivered = self.advance(now)
        self.core.abort(request_id)
        self._fresh.discard(request_id)
        self._stops.discard(request_id)
        self._resume(now)  # its blocks are free: a stalled admission may fit now
        return delivered

    def _resume(self, now: float) -> None:
        """The core's requests changed at ``now``: an idle or stalled core's next step starts then."""
        self._stalled = False
        if self._next_start is None and self.core.has_work():
            self._next_start = now

    def advance(self, now: float) -> tuple[dict[str, EngineOutput], list[KvEvent]]:
        """Compute every step that has started by ``now``; hand over the steps that have ended.

        Returns ``(outputs, kv_events)``: one merged output per request (in
        step order: tokens concatenated, the last finish reason, the first
        output's cached-token count) and the KV events of the delivered
        steps, in order.
        """
        core, held = self.core, self._held
        while not self._stalled and core.has_work() and self._next_start is not None:
            start = self._next_start
            if start > now:
                break
            step = core.step(now_ms=start * 1000.0)
            if not step.outputs and step.duration_ms == 0.0:
                self._stalled, self._next_start = True, None
                break
            urgent = bool(self._stops)
            for request_id, output in step.outputs.items():
                if request_id in self._fresh:
                    self._fresh.discard(request_id)
                    urgent = True
                if output.finish_reason is not None:
                    self._stops.discard(request_id)
                    urgent = True
            self._next_start = start + step.duration_ms / 1000.0
            held.append(_Held(self._next_start, step, urgent))
        if not core.has_work() and self._next_start is not None and self._next_start <= now:
            self._next_start = None  # idle: the next request's step starts when it arrives
        outputs: dict[str, EngineOutput] = {}
        events: list[KvEvent] = []
        while held and held[0].end_s <= now + EARLY_S:
            step = held.popleft().step
            for request_id, output in step.outputs.items():
                into = outputs.get(request_id)
                if into is None:
                    outputs[request_id] = output
                else:
                    into.token_ids.extend(output.token_ids)
                    into.finish_reason = output.finish_reason
            events += step.kv_events
        return outputs, events

    def next_wake(self) -> float | None:
        """When :meth:`advance` must run next (seconds), or None to wait for a request.

        The earliest of: the end of the first held step with a first token
        or a finish; the tick after the oldest held step's end (or, with
        none held, after the next step's start); the earliest start of a
        step that may hold a first token or a finish (the next start plus
        ``quiet_steps`` least step durations).
        """
        at = None
        if self._held:
            at = self._tick_after(self._held[0].end_s)
            for held in self._held:
                if held.urgent:
                    at = min(at, held.end_s)
                    break
        if not self._stalled and self._next_start is not None and self.core.has_work():
            # Steps not computed yet end after the next start: their tick is no earlier than its.
            may = min(self._next_start + self.core.quiet_steps() * self._min_step_s,
                      self._tick_after(self._next_start))
            at = may if at is None else min(at, may)
        return at

    def _tick_after(self, t: float) -> float:
        return (math.floor(t / self.interval_s) + 1) * self.interval_s

    def in_flight(self, now: float) -> StepResult | None:
        """The step running at ``now`` (computed, not ended), or None."""
        last = self._held[-1] if self._held else None
        return last.step if last is not None and last.end_s > now else None

    @property
    def holding(self) -> bool:
        """Whether computed steps wait to be delivered."""
        return bool(self._held)

    def take_held_events(self) -> list[KvEvent]:
        """The KV events of the steps not delivered yet, removed from them (for a
        KV dump, which must not be followed by events it already covers)."""
        events = [event for held in self._held for event in held.step.kv_events]
        for held in self._held:
            held.step.kv_events = []
        return events

    def clear(self) -> None:
        """Forget held steps and the step clock (the engine stopped)."""
        self._held.clear()
        self._next_start, self._stalled = None, False
        self._fresh.clear()
        self._stops.clear()
