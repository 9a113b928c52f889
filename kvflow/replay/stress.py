"""Stress traces for the SLA planner, written in the Azure LLM inference CSV format.

A planner tuned on one trace meets other shapes in production. Each shape
here is one traffic pattern a pool has to follow; all are drawn from one
seeded ``numpy`` generator, so a (shape, seed) pair always gives the same
file:

* ``step_burst``: Poisson arrivals at ``base_rate_per_s``; from
  ``burst_start_s`` the rate steps up ``burst_factor`` times (default ×4)
  for a duration drawn uniformly from ``[30, 60]`` s, then steps back.
  Conversation-like lengths.
* ``code``: long prompts, short outputs (code completion, retrieval): ISL
  log-normal around 2,000 tokens, OSL around 40, arrivals a Markov-modulated
  Poisson process that switches between a quiet and a busy rate (×3) with
  exponential sojourns of mean 40 s (bursty, not periodic).
* ``diurnal``: the rate follows one raised-cosine day compressed into the
  trace: ``base * (1 + (peak_factor - 1) * (1 - cos(2π t / T)) / 2)``, from
  ``base`` to ``peak_factor × base`` at mid-trace and back.
* ``isl_shift``: constant rate; at mid-trace the mean ISL jumps from ~600 to
  ~2,000 tokens (a new client with long prompts) while OSL stays.

Lengths are log-normal (``sigma`` 0.6 for ISL, 0.7 for OSL), clipped to
``[16, 4096]`` ISL (a 4k context; longer prompts alone take
most of a 500 ms TTFT to prefill on the slowed-down mocker the evaluation uses) and ``[2, 2048]`` OSL tokens. Inhomogeneous arrivals are
drawn by thinning (Lewis and Shedler, "Simulation of nonhomogeneous Poisson
processes by thinning", Naval Research Logistics Quarterly 26(3), 1979).

The CSV has the public trace's header ``TIMESTAMP,ContextTokens,GeneratedTokens``
with datetime stamps from an arbitrary day, so ``kvflow replay`` and
:func:`kvflow.replay.traces.read_trace` read it as an ``azure`` trace.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

__all__ = ["SHAPES", "StressRequest", "StressSpec", "generate", "write_azure_csv", "burst_window_s"]

_T0 = datetime(2024, 1, 1, 0, 0, 0)
_ISL_RANGE = (16, 4096)
_OSL_RANGE = (2, 2048)


@dataclass(frozen=True)
class StressRequest:
    """One generated request: arrival (s from trace start), prompt and output tokens."""

    arrival_s: float
    isl: int
    osl: int


@dataclass(frozen=True)
class StressSpec:
    """Knobs shared by the shapes (each shape reads the ones it names).

    Attributes:
        duration_s: trace length, s. Defaults to 600.
        base_rate_per_s: quiet arrival rate, requests/s. Defaults to 8.
        burst_factor: ``step_burst`` rate multiplier. Defaults to 4.
        burst_start_s: ``step_burst`` start, s. Defaults to 240.
        burst_min_s / burst_max_s: ``step_burst`` duration range, s. Defaults to 30 / 60.
        peak_factor: ``diurnal`` peak over base. Defaults to 4.
        isl_mean / osl_mean: conversation-like mean lengths, tokens. Defaults to 600 / 200.
        code_isl_mean / code_osl_mean: ``code`` mean lengths, tokens. Defaults to 2000 / 40.
        shifted_isl_mean: ``isl_shift`` mean ISL after the shift, tokens. Defaults to 2000.
    """

    duration_s: float = 600.0
    base_rate_per_s: float = 8.0
    burst_factor: float = 4.0
    burst_start_s: float = 240.0
    burst_min_s: float = 30.0
    burst_max_s: float = 60.0
    peak_factor: float = 4.0
    isl_mean: float = 600.0
    osl_mean: float = 200.0
    code_isl_mean: float = 2000.0
    code_osl_mean: float = 40.0
    shifted_isl_mean: float = 2000.0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.base_rate_per_s <= 0:
            raise ValueError("duration_s and base_rate_per_s must be > 0")
        if not 0 < self.burst_min_s <= self.burst_max_s:
            raise ValueError("need 0 < burst_min_s <= burst_max_s")
        if min(self.burst_factor, self.peak_factor) < 1:
            raise ValueError("burst_factor and peak_factor must be >= 1")


def _lengths(rng: np.random.Generator, mean: float, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    """``n`` log-normal lengths with the given mean (``mu = ln(mean) - sigma²/2``), clipped to ``[lo, hi]``."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(int)


def _thinned_arrivals(rng: np.random.Generator, rate: Callable[[float], float], rate_max: float,
                      duration_s: float) -> list[float]:
    """Arrival times of a Poisson process with intensity ``rate(t) <= rate_max`` on ``[0, duration_s)``."""
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate_max)
        if t >= duration_s:
            return out
        if rng.random() * rate_max < rate(t):
            out.append(t)


def burst_window_s(spec: StressSpec, seed: int) -> tuple[float, float]:
    """``step_burst``'s ``(start, end)`` in s for ``seed`` (the duration is the
    generator's first draw, so it is known without generating the trace)."""
    length = float(np.random.default_rng(seed).uniform(spec.burst_min_s, spec.burst_max_s))
    return spec.burst_start_s, spec.burst_start_s + length


def _step_burst(spec: StressSpec, rng: np.random.Generator) -> tuple[list[float], np.ndarray, np.ndarray]:
    length = float(rng.uniform(spec.burst_min_s, spec.burst_max_s))  # first draw: see burst_window_s
    start, end = spec.burst_start_s, spec.burst_start_s + length
    base = spec.base_rate_per_s
    t = _thinned_arrivals(rng, lambda s: base * (spec.burst_factor if start <= s < end else 1.0),
                          base * spec.burst_factor, spec.duration_s)
    return t, _lengths(rng, spec.isl_mean, 0.6, len(t), *_ISL_RANGE), _lengths(rng, spec.osl_mean, 0.7, len(t),
                                                                               *_OSL_RANGE)


def _code(spec: StressSpec, rng: np.random.Generator) -> tuple[list[float], np.ndarray, np.ndarray]:
    # Markov-modulated Poisson: quiet <-> busy (3x), exponential sojourns of mean 40 s.
    switches, t = [], 0.0
    while t < spec.duration_s:
        t += rng.exponential(40.0)
        switches.append(t)
    edges = np.asarray(switches)

    def rate(s: float) -> float:
        busy = int(np.searchsorted(edges, s, side="right")) % 2 == 1  # odd switches passed: busy
        return spec.base_rate_per_s * (3.0 if busy else 1.0)

    arr = _thinned_arrivals(rng, rate, spec.base_rate_per_s * 3.0, spec.duration_s)
    return arr, _lengths(rng, spec.code_isl_mean, 0.6, len(arr), *_ISL_RANGE), \
        _lengths(rng, spec.code_osl_mean, 0.7, len(arr), *_OSL_RANGE)


def _diurnal(spec: StressSpec, rng: np.random.Generator) -> tuple[list[float], np.ndarray, np.ndarray]:
    base, f, period = spec.base_rate_per_s, spec.peak_factor, spec.duration_s
    arr = _thinned_arrivals(rng, lambda s: base * (1 + (f - 1) * (1 - math.cos(2 * math.pi * s / period)) / 2),
                            base * f, spec.duration_s)
    return arr, _lengths(rng, spec.isl_mean, 0.6, len(arr), *_ISL_RANGE), \
        _lengths(rng, spec.osl_mean, 0.7, len(arr), *_OSL_RANGE)


def _isl_shift(spec: StressSpec, rng: np.random.Generator) -> tuple[list[float], np.ndarray, np.ndarray]:
    arr = _thinned_arrivals(rng, lambda s: spec.base_rate_per_s, spec.base_rate_per_s, spec.duration_s)
    before = _lengths(rng, spec.isl_mean, 0.6, len(arr), *_ISL_RANGE)
    after = _lengths(rng, spec.shifted_isl_mean, 0.6, len(arr), *_ISL_RANGE)
    isl = np.where(np.asarray(arr) < spec.duration_s / 2, before, after)
    return arr, isl, _lengths(rng, spec.osl_mean, 0.7, len(arr), *_OSL_RANGE)


SHAPES: dict[str, Callable[[StressSpec, np.random.Generator], tuple[list[float], np.ndarray, np.ndarray]]] = {
    "step_burst": _step_burst, "code": _code, "diurnal": _diurnal, "isl_shift": _isl_shift,
}
"""Shape name → generator (see the module docstring)."""


def generate(shape: str, spec: StressSpec | None = None, seed: int = 0) -> list[StressRequest]:
    """Requests of one stress shape, in arrival order.

    Raises:
        ValueError: unknown ``shape``.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    arrivals, isl, osl = SHAPES[shape](spec or StressSpec(), np.random.default_rng(seed))
    return [StressRequest(float(t), int(i), int(o)) for t, i, o in zip(arrivals, isl, osl)]


def write_azure_csv(requests: Sequence[StressRequest], path: str | Path) -> Path:
    """Write ``requests`` as ``TIMESTAMP,ContextTokens,GeneratedTokens`` rows (µs stamps); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for r in requests:
            ts = _T0 + timedelta(microseconds=round(r.arrival_s * 1e6))
            w.writerow([ts.strftime("%Y-%m-%d %H:%M:%S.%f"), r.isl, r.osl])
    return path
