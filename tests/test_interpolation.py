"""Interpolating profiles: hand-computed grids, clamping, infeasible cells."""

from __future__ import annotations

import pytest

from kvflow.planner.interpolation import LatencySurface, PerfFamily, PerfModel
from kvflow.planner.profile import DecodeProfile, PrefillProfile, Profile


@pytest.fixture
def surface() -> LatencySurface:
    # lengths 100/200 x concurrency 1/3; refine=2 adds the midpoint concurrency 2
    return LatencySurface(
        lengths=[100, 200], concurrency=[1, 3],
        latency_ms=[[10, 30], [20, 60]],
        throughput_tokens_per_s=[[100, 200], [150, 300]],
        refine=2,
    )


def test_curve_is_bilinear(surface: LatencySurface):
    conc, lat, thr = surface.curve(150)  # halfway between the rows
    assert conc.tolist() == [1, 2, 3]
    assert lat.tolist() == [15, 30, 45]
    assert thr.tolist() == [125, 187.5, 250]


def test_best_picks_highest_throughput_meeting_target(surface: LatencySurface):
    p = surface.best(150, latency_target_ms=30)
    assert (p.concurrency, p.latency_ms, p.throughput_tokens_per_s, p.meets_target) == (2, 30, 187.5, True)
    p = surface.best(150, latency_target_ms=44.9)
    assert (p.concurrency, p.throughput_tokens_per_s) == (2, 187.5)
    assert surface.best(150, latency_target_ms=100).throughput_tokens_per_s == 250


def test_best_unreachable_target_returns_lowest_latency(surface: LatencySurface):
    p = surface.best(150, latency_target_ms=10)
    assert (p.concurrency, p.latency_ms, p.throughput_tokens_per_s, p.meets_target) == (1, 15, 125, False)


def test_lengths_outside_profile_are_clamped(surface: LatencySurface):
    assert surface.best(50, 1000).latency_ms == 30  # clamped to length 100
    assert surface.best(10_000, 1000).latency_ms == 60  # clamped to length 200
    assert surface.best(10_000, 1000).throughput_tokens_per_s == 300


def test_latency_at_throughput_inverts_the_curve(surface: LatencySurface):
    # 156.25 tok/s lies halfway between c=1 (125 tok/s, 15 ms) and c=2 (187.5 tok/s, 30 ms)
    assert surface.latency_at_throughput(150, 156.25) == pytest.approx(22.5)
    assert surface.latency_at_throughput(150, 50) == 15  # below the first point: clamped
    assert surface.latency_at_throughput(150, 1e9) == 45  # past the peak: clamped
    assert surface.max_throughput(150) == 250


def test_infeasible_cells_are_never_chosen():
    s = LatencySurface([100, 200], [1, 2, 4],
                       latency_ms=[[10, 20, 40], [20, 40, None]],
                       throughput_tokens_per_s=[[100, 180, 300], [90, 160, None]], refine=4)
    p = s.best(200, latency_target_ms=1000)
    assert (p.concurrency, p.throughput_tokens_per_s) == (2, 160)  # exact profiled point next to a gap stays valid
    p = s.best(150, latency_target_ms=1000)  # halfway row: c=4 is infeasible in one neighbour, so here too
    assert (p.concurrency, p.throughput_tokens_per_s) == (2, 170)
    assert s.best(100, latency_target_ms=1000).concurrency == 4


def test_no_feasible_point_raises():
    s = LatencySurface([100], [1, 2], latency_ms=[[None, None]], throughput_tokens_per_s=[[None, None]])
    with pytest.raises(ValueError, match="no feasible point"):
        s.best(100, 50)


def test_single_concurrency_profile():
    s = LatencySurface([100, 300], [1], latency_ms=[[10], [30]], throughput_tokens_per_s=[[1000], [3000]])
    p = s.best(200, 25)
    assert p.meets_target is True and p.latency_ms == 20 and p.throughput_tokens_per_s == 2000
    assert s.best(200, 15).meets_target is False


def test_bad_grids_are_rejected():
    with pytest.raises(ValueError, match="shape"):
        LatencySurface([1, 2], [1], latency_ms=[[1]], throughput_tokens_per_s=[[1], [2]])
    with pytest.raises(ValueError, match="increasing"):
        LatencySurface([2, 1], [1], latency_ms=[[1], [2]], throughput_tokens_per_s=[[1], [2]])


def test_perf_model_from_profile_wires_prefill_and_decode():
    profile = Profile(
        engine="test",
        prefill=PrefillProfile(isl=[100, 200], concurrency=[1, 3], ttft_ms=[[10, 30], [20, 60]],
                               throughput_tokens_per_s=[[100, 200], [150, 300]]),
        decode=DecodeProfile(context_length=[1000], concurrency=[1, 2], itl_ms=[[5, 7]],
                             throughput_tokens_per_s=[[200, 285.0]], kv_usage=[[0.1, 0.2]]),
    )
    perf = PerfModel.from_profile(profile, refine=2)
    assert perf.prefill.best(150, 30).throughput_tokens_per_s == 187.5
    d = perf.decode.best(1000, 6)  # midpoint c=1.5: ITL 6 ms, 242.5 tok/s
    assert (d.concurrency, d.latency_ms, d.throughput_tokens_per_s) == (1.5, 6, 242.5)


def _osl_profile(osl: float, decode_tps: float) -> Profile:
    """A one-row profile at mean output length ``osl`` whose decode throughput is ``decode_tps`` at c=1."""
    return Profile(
        engine="test", engine_config={"osl": osl},
        prefill=PrefillProfile(isl=[100], concurrency=[1, 2], ttft_ms=[[10, 20]],
                               throughput_tokens_per_s=[[100, 150]]),
        decode=DecodeProfile(context_length=[100 + osl / 2], concurrency=[1, 2], itl_ms=[[5, 10]],
                             throughput_tokens_per_s=[[decode_tps, 2 * decode_tps]], kv_usage=[[None, None]]),
    )


def test_perf_family_blends_profiles_in_log_osl():
    family = PerfFamily.from_profiles([_osl_profile(160, 400.0), _osl_profile(40, 100.0)], refine=1)
    assert family.osls == [40.0, 160.0]
    # outside the profiled OSLs: the nearest profile, no extrapolation
    assert family.at_osl(10).decode.max_throughput(120) == 200.0
    assert family.at_osl(1000).decode.max_throughput(180) == 800.0
    # OSL 80 is halfway in log(OSL): cells and context lengths are averaged
    mid = family.at_osl(80)
    assert mid.decode.lengths.tolist() == pytest.approx([150.0], rel=0.01)
    assert mid.decode.max_throughput(150) == pytest.approx(500.0, rel=0.01)
    assert family.at_osl(80) is mid  # cached
    # one profile answers for every OSL
    single = PerfModel.from_profile(_osl_profile(40, 100.0))
    assert single.at_osl(500) is single


def test_perf_family_rejects_profiles_without_osl_or_other_grids():
    bare = _osl_profile(40, 100.0).model_copy(update={"engine_config": {}})
    with pytest.raises(ValueError, match="OSL"):
        PerfFamily.from_profiles([bare])
    other = Profile(
        engine="test", engine_config={"osl": 80},
        prefill=PrefillProfile(isl=[100], concurrency=[1], ttft_ms=[[10]], throughput_tokens_per_s=[[100]]),
        decode=DecodeProfile(context_length=[140], concurrency=[1], itl_ms=[[5]],
                             throughput_tokens_per_s=[[100]], kv_usage=[[None]]))
    with pytest.raises(ValueError, match="grids differ"):
        PerfFamily.from_profiles([_osl_profile(40, 100.0), other])


def test_perf_model_reads_p99_grids_for_a_p99_target():
    base = _osl_profile(40, 100.0)
    profile = base.model_copy(update={"decode": base.decode.model_copy(update={"itl_p99_ms": [[8, 16]]}),
                                      "prefill": base.prefill.model_copy(update={"ttft_p99_ms": [[15, 30]]})})
    mean = PerfModel.from_profile(profile, refine=1)
    p99 = PerfModel.from_profile(profile, refine=1, ttft_statistic="p99", itl_statistic="p99")
    assert mean.decode.best(120, 10).throughput_tokens_per_s == 200.0  # mean ITL 10 ms at c=2
    assert p99.decode.best(120, 10).throughput_tokens_per_s == 100.0  # p99 ITL 16 ms at c=2: only c=1 meets 10
    assert p99.prefill.best(100, 20).throughput_tokens_per_s == 100.0
    # a profile without p99 grids falls back to the mean ones
    assert PerfModel.from_profile(base, refine=1, itl_statistic="p99").decode.best(120, 10).concurrency == 2
