"""The planner's pure decision core on a hand-made profile with round numbers.

Profile (refine=1, so only profiled points are candidates):

* prefill, any ISL: 1 prompt -> TTFT 100 ms at 10000 tok/s; 4 prompts -> 250 ms at 16000 tok/s
  (ISL 2000 doubles the TTFTs);
* decode, any context: 1 seq -> ITL 10 ms at 100 tok/s; 64 seqs -> 40 ms at 1600 tok/s.

With TTFT target 300 ms and ITL target 50 ms a prefill replica serves 16000
tok/s and a decode replica 1600 tok/s.
"""

from __future__ import annotations

import pytest

from kvflow.planner.core import (
    PlannerConfig,
    PlannerMode,
    TickInput,
    TrafficObservation,
    initial_state,
    on_tick,
    scaling_commands,
)
from kvflow.planner.interpolation import PerfModel
from kvflow.planner.profile import DecodeProfile, PrefillProfile, Profile
from kvflow.schemas.scaling import ScalingCommand
from kvflow.schemas.workers import WorkerRole

P, D, A = WorkerRole.prefill, WorkerRole.decode, WorkerRole.aggregated
INTERVAL_S = 60


@pytest.fixture(scope="module")
def perf() -> PerfModel:
    profile = Profile(
        engine="test",
        prefill=PrefillProfile(isl=[1000, 2000], concurrency=[1, 4], ttft_ms=[[100, 250], [200, 500]],
                               throughput_tokens_per_s=[[10000, 16000], [10000, 16000]]),
        decode=DecodeProfile(context_length=[1000, 2000], concurrency=[1, 64], itl_ms=[[10, 40], [10, 40]],
                             throughput_tokens_per_s=[[100, 1600], [100, 1600]], kv_usage=[[0.01, 0.5]] * 2),
    )
    return PerfModel.from_profile(profile, refine=1)


def cfg(**kw) -> PlannerConfig:
    base = dict(ttft_ms=300, itl_ms=50, adjustment_interval_s=INTERVAL_S, max_gpus=16, scale_down_hold_intervals=3)
    return PlannerConfig(**(base | kw))


def traffic(rate: float, isl: float = 1000, osl: float = 200, ttft=None, itl=None, cached=None) -> TrafficObservation:
    n = int(round(rate * INTERVAL_S))
    return TrafficObservation(duration_s=INTERVAL_S, num_requests=n, mean_isl=isl if n else None,
                              mean_osl=osl if n else None, mean_ttft_ms=ttft, mean_itl_ms=itl,
                              mean_cached_tokens=cached)


def run(state, rates, current=None, **obs):
    """Tick once per rate, feeding each tick's targets back as the running replicas."""
    current = dict(current or {p: 1 for p in state.config.pools})
    history = []
    for i, rate in enumerate(rates):
        state, fx = on_tick(state, TickInput(now_ms=(i + 1) * INTERVAL_S * 1000, traffic=traffic(rate, **obs),
                                             current_replicas=current))
        current = {d.pool: d.target_replicas for d in fx.decisions}
        history.append((fx, current))
    return state, history


def test_steady_load_sizes_pools_by_profile(perf):
    # 10 req/s x 1000 tok = 10000 tok/s -> 0.625 prefill replica; 10 x 200 = 2000 tok/s -> 1.25 decode
    _, hist = run(initial_state(cfg(), perf), [10])
    fx, targets = hist[-1]
    assert targets == {P: 1, D: 2}
    d = {x.pool: x for x in fx.decisions}
    assert d[P].point.throughput_tokens_per_s == 16000 and d[P].point.latency_ms == 250
    assert d[D].demand_tokens_per_s == pytest.approx(2000)
    assert fx.prediction.request_rate_per_s == pytest.approx(10)


def test_burst_scales_up_immediately(perf):
    # 50 req/s: prefill 50000/16000 = 3.125 -> 4; decode 10000/1600 = 6.25 -> 7
    _, hist = run(initial_state(cfg(), perf), [10, 10, 50])
    assert [h[1] for h in hist] == [{P: 1, D: 2}, {P: 1, D: 2}, {P: 4, D: 7}]
    assert all("scale up" in d.reason for d in hist[-1][0].decisions)


def test_scale_down_only_after_hold_period(perf):
    _, hist = run(initial_state(cfg(scale_down_hold_intervals=3), perf), [50, 10, 10, 10, 10])
    targets = [h[1] for h in hist]
    assert targets == [{P: 4, D: 7}, {P: 4, D: 7}, {P: 4, D: 7}, {P: 1, D: 2}, {P: 1, D: 2}]
    assert "1/3" in hist[1][0].decisions[0].reason and "scale down 4 -> 1" in hist[3][0].decisions[0].reason


def test_scale_down_goes_to_highest_need_of_the_hold_run(perf):
    # needs after the burst: decode 7 -> then 3, 5, 2 (rates 20, 35, 10); hold 3 -> scale to max(3, 5, 2) = 5
    _, hist = run(initial_state(cfg(), perf), [50, 20, 35, 10])
    assert [h[1][D] for h in hist] == [7, 7, 7, 5]


def test_scale_down_window_slides_so_a_burst_pool_falls_in_one_hold(perf):
    # needs after the burst: decode 7 -> 6, 3, 2, 2 (rates 45, 20, 10, 10); hold 3:
    # the third lower tick steps to max(6, 3, 2) = 6, the next to max(3, 2, 2) = 3, without a new full hold
    _, hist = run(initial_state(cfg(), perf), [50, 45, 20, 10, 10, 10])
    assert [h[1][D] for h in hist] == [7, 7, 7, 6, 3, 2]
    assert "highest need of the last 3 intervals" in hist[4][0].decisions[1].reason


def test_noise_does_not_flap(perf):
    # decode need alternates 2 (14 req/s -> 1.75) and 3 (17 req/s -> 2.125)
    _, hist = run(initial_state(cfg(), perf), [14, 17] * 10)
    decode_targets = [h[1][D] for h in hist]
    changes = sum(a != b for a, b in zip(decode_targets, decode_targets[1:]))
    assert decode_targets[0] == 2 and changes == 1 and decode_targets[-1] == 3


def test_kalman_predictor_also_holds_steady_under_noise(perf):
    _, hist = run(initial_state(cfg(predictor="kalman", predictor_kwargs={"trend": False}), perf), [14, 17] * 10)
    decode_targets = [h[1][D] for h in hist]
    assert sum(a != b for a, b in zip(decode_targets, decode_targets[1:])) <= 1


def test_gpu_budget_caps_targets_proportionally(perf):
    _, hist = run(initial_state(cfg(max_gpus=6), perf), [50])
    fx, targets = hist[-1]
    assert targets == {P: 2, D: 4}  # wanted 4 + 7 = 11 GPUs; trimmed keeping ~ the 4:7 split
    assert all("GPU budget 6" in d.reason for d in fx.decisions)
    assert {d.pool: d.needed_replicas for d in fx.decisions} == {P: 4, D: 7}


def test_gpu_budget_counts_gpus_per_replica(perf):
    _, hist = run(initial_state(cfg(max_gpus=12, decode_gpus_per_replica=2), perf), [50])
    targets = hist[-1][1]
    assert targets[P] + 2 * targets[D] <= 12 and targets[P] >= 1 and targets[D] >= 1


def test_minimums_hold_without_traffic(perf):
    state = initial_state(cfg(min_prefill_replicas=2, min_decode_replicas=3), perf)
    _, hist = run(state, [0, 0], current={P: 2, D: 3})
    fx, targets = hist[-1]
    assert targets == {P: 2, D: 3}
    assert fx.prediction.isl is None and all(d.point is None for d in fx.decisions)


def test_a_pool_at_zero_is_not_left_at_zero_while_requests_wait(perf):
    state = initial_state(cfg(min_prefill_replicas=0, min_decode_replicas=0), perf)
    state, fx = on_tick(state, TickInput(now_ms=1, traffic=traffic(0), current_replicas={P: 0, D: 0}))
    assert (fx.target(P), fx.target(D)) == (0, 0)  # idle: scaled to zero
    _, fx = on_tick(state, TickInput(now_ms=2, traffic=traffic(0), current_replicas={P: 0, D: 0}, waiting_requests=3))
    # held requests need a decode replica (prefill can run on it); nothing finished yet to size more
    assert (fx.target(P), fx.target(D)) == (0, 1)
    assert "3 requests wait: at least 1 replica" in fx.decisions[1].reason


def test_the_prefill_pool_is_sized_from_its_own_requests(perf):
    # decode serves 10 req/s (2000 out tok/s -> 2 replicas); only 4 req/s of 2000-token prompts were
    # prefilled remotely: 8000 tok/s, at 2000 tokens 10000 tok/s per replica meet TTFT 300 ms -> 1 replica
    tick = TickInput(now_ms=1, traffic=traffic(10, isl=1000), current_replicas={P: 1, D: 2},
                     prefill_traffic=traffic(4, isl=2000))
    state, fx = on_tick(initial_state(cfg(), perf), tick)
    assert fx.target(D) == 2 and fx.target(P) == 1
    assert "4.00 req/s x 2000 new tok = 8000 tok/s" in fx.decisions[0].reason
    assert state.prefill_predictors.rate.history[-1] == pytest.approx(4.0)
    assert state.predictors.rate.history[-1] == pytest.approx(10.0)
    # the prefill pool's own burst scales prefill alone
    _, fx = on_tick(state, TickInput(now_ms=2, traffic=traffic(10, isl=1000), current_replicas={P: 1, D: 2},
                                     prefill_traffic=traffic(30, isl=2000)))
    assert (fx.target(P), fx.target(D)) == (6, 2)  # 60000 tok/s / 10000
    with pytest.raises(ValueError, match="disaggregated mode only"):
        on_tick(initial_state(cfg(mode="aggregated"), perf), tick)


def test_initial_overprovisioning_is_held_before_scaling_down(perf):
    _, hist = run(initial_state(cfg(), perf), [10, 10, 10], current={P: 5, D: 5})
    assert [h[1] for h in hist] == [{P: 5, D: 5}, {P: 5, D: 5}, {P: 1, D: 2}]


def test_prefill_correction_tightens_ttft_goal(perf):
    # 15 req/s on 1 prefill replica = 15000 tok/s: the profile expects 100 + 5000/6000 * 150 = 225 ms.
    # Observed 450 ms -> correction 2 -> goal 150 ms -> only the 1-prompt point (10000 tok/s) -> 2 replicas.
    state = initial_state(cfg(), perf)
    state, fx = on_tick(state, TickInput(now_ms=1, traffic=traffic(15, ttft=450), current_replicas={P: 1, D: 2}))
    assert fx.prefill_correction == pytest.approx(2.0)
    assert fx.target(P) == 2
    _, plain = on_tick(initial_state(cfg(), perf),
                       TickInput(now_ms=1, traffic=traffic(15), current_replicas={P: 1, D: 2}))
    assert plain.prefill_correction == 1.0 and plain.target(P) == 1


def test_decode_correction_tightens_itl_goal(perf):
    # 10 req/s x 200 = 2000 tok/s on 2 decode replicas = 1000 each: expected ITL 10 + 900/1500 * 30 = 28 ms
    tick = TickInput(now_ms=1, traffic=traffic(10, itl=56), current_replicas={P: 1, D: 2})
    _, fx = on_tick(initial_state(cfg(max_gpus=64, max_scale_up_factor=None), perf), tick)
    assert fx.decode_correction == pytest.approx(2.0)
    assert fx.target(D) == 20  # goal 25 ms admits only 1 seq/replica: 2000 / 100


def test_correction_driven_growth_is_bounded_per_tick(perf):
    # as above, but the default cap: without corrections 2 replicas would do, so the pool grows x2 per tick
    tick = TickInput(now_ms=1, traffic=traffic(10, itl=56), current_replicas={P: 1, D: 2})
    state, fx = on_tick(initial_state(cfg(max_gpus=64), perf), tick)
    d = {x.pool: x for x in fx.decisions}[D]
    assert (d.needed_replicas, d.target_replicas) == (20, 4) and "2 before corrections" in d.reason
    # the bigger pool still measures ITL 2x the profile's: next tick doubles again
    state, fx = on_tick(state, TickInput(now_ms=2, traffic=traffic(10, itl=2 * (10 + 400 / 1500 * 30)),
                                         current_replicas={P: 1, D: 4}))
    assert fx.decode_correction == pytest.approx(2.0) and fx.target(D) == 8


def test_demand_growth_is_not_bounded(perf):
    # a 5x burst with accurate latencies scales straight to the need (2 -> 7 decode replicas)
    _, hist = run(initial_state(cfg(max_scale_up_factor=1.5), perf), [10, 50])
    assert hist[-1][1] == {P: 4, D: 7}


def test_correction_smoothing_averages_intervals(perf):
    # Same interval as above (expected TTFT 225 ms). Observed 450 -> raw factor 2; with weight 0.25 the
    # factor moves a quarter of the way from 1: 1.25, then 1.4375 after a second identical interval.
    state = initial_state(cfg(correction_smoothing=0.25), perf)
    tick = TickInput(now_ms=1, traffic=traffic(15, ttft=450), current_replicas={P: 1, D: 2})
    state, fx = on_tick(state, tick)
    assert fx.prefill_correction == pytest.approx(1.25)
    state, fx = on_tick(state, tick)
    assert fx.prefill_correction == pytest.approx(1.4375)
    with pytest.raises(ValueError, match="correction_smoothing"):
        cfg(correction_smoothing=0.0)


def test_p99_statistic_corrects_with_the_tail(perf):
    # Same decode interval as above (expected ITL 28 ms at 1000 tok/s per replica): mean 28 ms matches the
    # profile, p99 56 ms is twice it. The mean planner keeps factor 1 and 2 replicas; the p99 planner takes
    # factor 2, so its 50 ms goal becomes 25 ms (1 seq per replica) and it grows x2 per tick towards 20.
    obs = TrafficObservation(duration_s=INTERVAL_S, num_requests=600, mean_isl=1000, mean_osl=200,
                             mean_ttft_ms=100, mean_itl_ms=28, p99_ttft_ms=100, p99_itl_ms=56)
    tick = TickInput(now_ms=1, traffic=obs, current_replicas={P: 1, D: 2})
    _, mean_fx = on_tick(initial_state(cfg(max_gpus=64), perf), tick)
    assert mean_fx.decode_correction == pytest.approx(1.0) and mean_fx.target(D) == 2
    _, p99_fx = on_tick(initial_state(cfg(max_gpus=64, itl_statistic="p99"), perf), tick)
    d = {x.pool: x for x in p99_fx.decisions}[D]
    assert p99_fx.decode_correction == pytest.approx(2.0)
    assert (d.needed_replicas, d.target_replicas) == (20, 4)
    # prefill: the p99 TTFT statistic reads p99_ttft_ms (2x the expected 225 ms at 15 req/s on one replica)
    obs = TrafficObservation(duration_s=INTERVAL_S, num_requests=900, mean_isl=1000, mean_osl=200,
                             mean_ttft_ms=225, p99_ttft_ms=450)
    _, fx = on_tick(initial_state(cfg(ttft_statistic="p99"), perf),
                    TickInput(now_ms=1, traffic=obs, current_replicas={P: 1, D: 2}))
    assert fx.prefill_correction == pytest.approx(2.0) and fx.target(P) == 2


def test_p99_statistic_without_a_p99_keeps_the_last_factor(perf):
    state = initial_state(cfg(itl_statistic="p99", ttft_statistic="p99"), perf)
    state, fx = on_tick(state, TickInput(now_ms=1, traffic=traffic(10, ttft=450, itl=56),
                                         current_replicas={P: 1, D: 2}))
    assert (fx.prefill_correction, fx.decode_correction) == (1.0, 1.0)
    with pytest.raises(ValueError, match="itl_statistic"):
        cfg(itl_statistic="p95")


def test_corrections_are_clamped_and_skip_overloaded_replicas(perf):
    state = initial_state(cfg(correction_max=3.0), perf)
    _, fx = on_tick(state, TickInput(now_ms=1, traffic=traffic(5, ttft=10_000), current_replicas={P: 1, D: 1}))
    assert fx.prefill_correction == 3.0
    # 50 req/s on one replica is 50000 tok/s, past its 16000 tok/s peak: its TTFT says nothing about the profile
    _, fx = on_tick(state, TickInput(now_ms=1, traffic=traffic(50, ttft=10_000), current_replicas={P: 1, D: 7}))
    assert fx.prefill_correction == 1.0


def test_kv_hits_discount_prefill_demand(perf):
    # 32 req/s x 1000 tok = 32000 tok/s -> 2 prefill replicas; half the prompt cached -> 16000 tok/s -> 1
    _, cold = run(initial_state(cfg(), perf), [32])
    _, warm = run(initial_state(cfg(), perf), [32], cached=500)
    assert cold[-1][1][P] == 2 and warm[-1][1][P] == 1
    assert warm[-1][0].prediction.kv_hit_rate == 0.5


@pytest.mark.parametrize(("sizing", "expected"), [("max", 3), ("sum", 4)])
def test_aggregated_mode_sizes_one_pool(perf, sizing, expected):
    # 20 req/s: prefill need 20000/16000 = 1.25, decode 4000/1600 = 2.5
    state = initial_state(cfg(mode=PlannerMode.aggregated, aggregated_sizing=sizing), perf)
    _, hist = run(state, [20])
    fx, targets = hist[-1]
    assert targets == {A: expected}
    assert [d.pool for d in fx.decisions] == [A]


def test_on_tick_is_pure(perf):
    state = initial_state(cfg(predictor="kalman"), perf)
    tick = TickInput(now_ms=5, traffic=traffic(20), current_replicas={P: 1, D: 1})
    s1, fx1 = on_tick(state, tick)
    s2, fx2 = on_tick(state, tick)
    assert fx1 == fx2
    assert state.predictors.rate.num_observations == 0 and state.targets == {} and state.num_ticks == 0
    assert s1.predictors.rate.num_observations == 1 and s2.num_ticks == 1


def test_scaling_commands_for_changed_pools_only(perf):
    state = initial_state(cfg(), perf)
    _, fx = on_tick(state, TickInput(now_ms=120_000, traffic=traffic(10), current_replicas={P: 1, D: 1}))
    cmds = scaling_commands(fx)
    assert cmds == [ScalingCommand(decision_id="120000-decode", pool=D, target_replicas=2, current_replicas=1,
                                   reason=cmds[0].reason, ts_ms=120_000)]
    assert cmds[0].reason.startswith("decode: scale up 1 -> 2")
    assert [c.pool for c in scaling_commands(fx, only_changed=False)] == [P, D]


def test_invalid_configs_are_rejected():
    with pytest.raises(ValueError, match="GPUs > max_gpus"):
        PlannerConfig(min_prefill_replicas=4, min_decode_replicas=4, max_gpus=7)
    with pytest.raises(ValueError, match="predictor"):
        PlannerConfig(predictor="lstm")
    with pytest.raises(ValueError, match="correction"):
        PlannerConfig(correction_min=2.0)
