"""Stress-trace generator: deterministic by seed, each shape has its feature, readable as an Azure trace."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.replay.stress import SHAPES, StressSpec, burst_window_s, generate, write_azure_csv
from kvflow.replay.traces import detect_format, read_trace

SPEC = StressSpec(duration_s=300.0, base_rate_per_s=4.0, burst_start_s=120.0)


def _rate(reqs, t0: float, t1: float) -> float:
    return sum(1 for r in reqs if t0 <= r.arrival_s < t1) / (t1 - t0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_same_seed_same_trace_other_seed_other_trace(shape: str) -> None:
    assert generate(shape, SPEC, seed=3) == generate(shape, SPEC, seed=3)
    assert generate(shape, SPEC, seed=3) != generate(shape, SPEC, seed=4)


def test_step_burst_quadruples_the_rate_inside_its_window() -> None:
    reqs = generate("step_burst", SPEC, seed=1)
    start, end = burst_window_s(SPEC, seed=1)
    assert start == 120.0 and 30.0 <= end - start <= 60.0
    inside, before = _rate(reqs, start, end), _rate(reqs, 0.0, start)
    assert 2.8 < inside / before < 5.5  # x4 within Poisson noise over >= 30 s


def test_code_traffic_has_long_prompts_and_short_outputs() -> None:
    reqs = generate("code", SPEC, seed=0)
    isl, osl = np.mean([r.isl for r in reqs]), np.mean([r.osl for r in reqs])
    assert isl > 1500 and osl < 80 and isl / osl > 30


def test_diurnal_peaks_mid_trace() -> None:
    reqs = generate("diurnal", SPEC, seed=0)
    assert _rate(reqs, 120, 180) > 2.5 * _rate(reqs, 0, 30)


def test_isl_shift_moves_the_prompt_length_at_mid_trace() -> None:
    reqs = generate("isl_shift", SPEC, seed=0)
    first = np.mean([r.isl for r in reqs if r.arrival_s < 150])
    second = np.mean([r.isl for r in reqs if r.arrival_s >= 150])
    assert second > 2.5 * first


def test_written_csv_reads_back_as_an_azure_trace(tmp_path) -> None:
    reqs = generate("step_burst", SPEC, seed=0)
    path = write_azure_csv(reqs, tmp_path / "burst.csv")
    assert detect_format(path) == "azure"
    trace = read_trace(path)
    assert [(r.isl, r.osl) for r in trace.requests] == [(r.isl, r.osl) for r in reqs]
    # arrival times are relative to the first request, to the microsecond
    assert trace.requests[-1].arrival_ms == pytest.approx((reqs[-1].arrival_s - reqs[0].arrival_s) * 1000, abs=0.01)


def test_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        generate("sawtooth")
