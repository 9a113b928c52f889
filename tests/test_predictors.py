"""Load predictors on synthetic series with known next values."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest

from kvflow.planner.predictors import ArimaPredictor, KalmanPredictor, NotReadyError, make_predictor

N = 30


def _feed(p, values):
    for v in values:
        p.observe(v)
    return p


def _noisy_trend(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 10 + 3 * np.arange(N) + rng.normal(0, 0.5, N)  # next true value: 10 + 3 * N = 100


@pytest.mark.parametrize("name", ["constant", "arima", "kalman", "max_recent", "quantile", "backtest"])
def test_constant_series_predicts_the_constant(name):
    assert _feed(make_predictor(name), [42.0] * N).predict() == pytest.approx(42.0, abs=1e-9)


def test_constant_predictor_returns_last_value_and_skips_nan():
    p = _feed(make_predictor("constant"), [1.0, 5.0, float("nan"), float("inf")])
    assert p.predict() == 5.0
    assert p.num_observations == 2


@pytest.mark.parametrize("name", ["constant", "arima", "kalman", "max_recent", "quantile", "backtest"])
def test_predict_before_observe_raises(name):
    with pytest.raises(NotReadyError):
        make_predictor(name).predict()


def test_unknown_predictor_is_rejected():
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("lstm")


@pytest.mark.parametrize("name", ["kalman", "arima"])
def test_noisy_linear_trend_converges_to_next_value(name):
    y = _noisy_trend()
    pred = _feed(make_predictor(name), y).predict()
    assert abs(pred - 100.0) < 1.5  # within half a step of the slope (3) ...
    assert abs(pred - 100.0) < abs(y[-1] - 100.0)  # ... and better than repeating the last value


def test_kalman_tracks_exact_trend_exactly():
    p = _feed(KalmanPredictor(), 5 + 2 * np.arange(N, dtype=float))
    assert p.predict() == pytest.approx(5 + 2 * N, abs=1e-3)


def test_kalman_is_scale_free():
    y = _noisy_trend(1)
    small = _feed(KalmanPredictor(), y).predict()
    large = _feed(KalmanPredictor(), 1000 * y).predict()
    assert large == pytest.approx(1000 * small, rel=1e-9)


def test_kalman_local_level_smooths_noise():
    rng = np.random.default_rng(2)
    y = 100 + rng.normal(0, 5, 200)
    p = _feed(KalmanPredictor(trend=False, level_noise=0.01), y)
    assert abs(p.predict() - 100) < 2.5  # the noise sd is 5; the filter averages many points


def test_arima_falls_back_to_last_value_until_enough_points():
    p = _feed(ArimaPredictor(min_points=8), [1.0, 4.0, 2.0])
    assert p.predict() == 2.0


def test_arima_window_bounds_history():
    p = _feed(ArimaPredictor(window=10), range(25))
    assert p.num_observations == 10 and list(p.history) == list(range(15, 25))


def test_copies_are_independent():
    p = _feed(make_predictor("kalman"), [1.0, 2.0, 3.0])
    before = p.predict()
    q = copy.deepcopy(p)
    _feed(q, [50.0, 80.0])
    assert p.predict() == before and q.predict() != before


@pytest.mark.skipif(importlib.util.find_spec("prophet") is not None, reason="prophet is installed")
def test_prophet_without_the_extra_says_how_to_install():
    with pytest.raises(ImportError, match=r"kvflow\[prophet\]"):
        make_predictor("prophet")


@pytest.mark.skipif(importlib.util.find_spec("prophet") is None, reason="optional prophet extra not installed")
def test_prophet_follows_a_trend():
    pred = _feed(make_predictor("prophet", interval_s=60), _noisy_trend()).predict()
    assert abs(pred - 100.0) < 3.0


def test_max_recent_holds_a_burst_for_its_lookback():
    p = _feed(make_predictor("max_recent", lookback=3), [10, 40, 10])
    assert p.predict() == 40
    p.observe(10)
    p.observe(10)
    assert p.predict() == 10


def test_quantile_ignores_one_outlier_less_than_max():
    p = _feed(make_predictor("quantile", q=0.9, lookback=10), [10] * 9 + [100])
    assert 10 < p.predict() < 100


def test_backtest_picks_the_candidate_that_under_forecasts_least():
    # A series alternating 10/50: "constant" is always wrong by 40 (under every other
    # interval), "max_recent" over-forecasts by 40 half the time and is never under.
    p = _feed(make_predictor("backtest", candidates=("constant", "max_recent")), [10, 50] * 8)
    assert p.chosen == "constant"  # nothing was forecast yet
    assert p.predict() == 50
    assert p.chosen == "max_recent"
    scores = p.scores()
    assert scores["max_recent"] < scores["constant"]


def test_backtest_on_a_steady_trend_prefers_the_trend_model():
    p = _feed(make_predictor("backtest", candidates=("max_recent", "kalman")), _noisy_trend())
    assert abs(p.predict() - 100.0) < 3.0
    assert p.chosen == "kalman"


def test_backtest_refuses_itself_as_a_candidate():
    with pytest.raises(ValueError):
        make_predictor("backtest", candidates=("backtest",))


def test_predict_ahead_extrapolates_the_kalman_trend_and_holds_a_level():
    k = _feed(make_predictor("kalman"), [10.0 + 2 * i for i in range(N)])
    assert k.predict_ahead(1) == pytest.approx(k.predict())
    assert k.predict_ahead(3) == pytest.approx(k.predict() + 4.0, abs=0.1)
    c = _feed(make_predictor("constant"), [1.0, 7.0])
    assert c.predict_ahead(5) == 7.0
    with pytest.raises(NotReadyError):
        make_predictor("max_recent").predict_ahead(2)
