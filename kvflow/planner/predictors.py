"""Load predictors: forecast next interval's value of a scalar series.

The planner keeps one predictor per load signal (request rate, mean ISL, mean
OSL), feeds it one observation per adjustment interval and asks for the next
interval's value. Every predictor has the same two-method interface
(:class:`LoadPredictor`): ``observe(value)`` and ``predict() -> float``.

* ``constant`` — the last observed value.
* ``arima`` — a statsmodels ARIMA refitted on a sliding window.
* ``kalman`` — a local-level or local-linear-trend Kalman filter in numpy.
* ``prophet`` — Facebook Prophet (optional extra ``kvflow[prophet]``).
* ``max_recent`` — the largest of the last few values (burst-aware: a burst
  keeps the forecast up until it has passed for that many intervals).
* ``quantile`` — a high quantile of the last values.
* ``backtest`` — runs several of the above side by side, scores each one's
  one-step forecasts over the recent window and answers with the best.

Predictions are not clipped; a caller forecasting a non-negative quantity
clips at 0 itself. Predictors are small plain objects, cheap to ``deepcopy``
(the planner core copies them so that its tick function stays pure).
"""

from __future__ import annotations

import abc
import math
import warnings
from collections import deque

import numpy as np

__all__ = [
    "LoadPredictor", "ConstantPredictor", "ArimaPredictor", "KalmanPredictor", "ProphetPredictor",
    "MaxRecentPredictor", "QuantilePredictor", "BacktestPredictor", "make_predictor", "PREDICTORS",
    "NotReadyError",
]


class NotReadyError(RuntimeError):
    """``predict()`` was called before any observation."""


class LoadPredictor(abc.ABC):
    """Forecasts the next value of a series observed once per interval.

    Subclasses implement :meth:`_forecast`; the base class keeps a bounded
    history and ignores non-finite observations (a missing measurement is not
    a zero).
    """

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.history: deque[float] = deque(maxlen=window)
        """The most recent ``window`` observations, oldest first."""

    @property
    def num_observations(self) -> int:
        """Observations currently held (at most ``window``)."""
        return len(self.history)

    def observe(self, value: float) -> None:
        """Record the value measured over the interval that just ended. NaN/inf are ignored."""
        value = float(value)
        if math.isfinite(value):
            self.history.append(value)
            self._on_observe(value)

    def predict(self) -> float:
        """Forecast the value for the next interval.

        Raises:
            NotReadyError: nothing was observed yet.
        """
        if not self.history:
            raise NotReadyError(f"{type(self).__name__} has no observations")
        return float(self._forecast())

    def predict_ahead(self, steps: float) -> float:
        """Forecast ``steps`` intervals ahead (``steps >= 1``; 1 is :meth:`predict`).

        The planner asks this when a new replica takes longer than an
        interval to start: it must be sized for the load when it is ready.
        Predictors without a trend answer their one-step forecast; the
        Kalman trend model extrapolates its slope; backtest asks its choice.

        Raises:
            NotReadyError: nothing was observed yet.
        """
        self.predict()  # raises NotReadyError before any observation
        return float(self._forecast_ahead(max(1.0, float(steps))))

    def _forecast_ahead(self, steps: float) -> float:
        return self._forecast()

    def _on_observe(self, value: float) -> None:
        """Hook for predictors with recursive state (Kalman)."""

    @abc.abstractmethod
    def _forecast(self) -> float:
        """Next value; ``self.history`` is non-empty."""


class ConstantPredictor(LoadPredictor):
    """Predicts that the next interval looks like the last one."""

    def _forecast(self) -> float:
        return self.history[-1]


class ArimaPredictor(LoadPredictor):
    """ARIMA(p, d, q) refitted by maximum likelihood on the last ``window`` points.

    The default order is (1, 1, 1) without a constant: one difference removes
    a level or a linear trend (the AR(1) term on the differences then carries
    the slope), and the MA(1) term smooths noise. On a noisy linear trend, a
    noisy level and a step change it forecasts within a few percent of the
    truth after ~20 points, which a drift term (``trend="t"``) does not beat
    and overshoots on steps. Statsmodels: ``statsmodels.tsa.arima.model.ARIMA``.

    Until ``min_points`` observations exist, and whenever the window is
    constant or the fit fails or diverges, it returns the last value.

    Args:
        order: ARIMA (p, d, q).
        trend: statsmodels trend code (``"n"`` none, ``"t"`` drift with d=1).
        min_points: observations needed before fitting.
        window: history kept (fit cost grows with it; ~10-40 ms at 64).
    """

    def __init__(self, order: tuple[int, int, int] = (1, 1, 1), trend: str = "n",
                 min_points: int = 8, window: int = 64) -> None:
        super().__init__(window)
        self.order = tuple(order)
        self.trend = trend
        self.min_points = max(min_points, sum(self.order) + 2)

    def _forecast(self) -> float:
        last = self.history[-1]
        y = np.fromiter(self.history, dtype=float)
        if len(y) < self.min_points or np.ptp(y) == 0.0:
            return last
        from statsmodels.tsa.arima.model import ARIMA  # imported lazily: ~1 s import

        try:
            with warnings.catch_warnings():
                # Convergence and start-parameter warnings are expected on short
                # windows; a bad fit is caught by the sanity check below.
                warnings.simplefilter("ignore")
                fit = ARIMA(y, order=self.order, trend=self.trend).fit()
                value = float(fit.forecast(1)[0])
        except (ValueError, np.linalg.LinAlgError):
            return last
        # Reject a forecast further from the window than the window's own span.
        span = float(np.ptp(y))
        if not math.isfinite(value) or not (y.min() - span <= value <= y.max() + span):
            return last
        return value


class KalmanPredictor(LoadPredictor):
    """Kalman filter on a local-level (``trend=False``) or local-linear-trend model.

    State ``x = [level, slope]``; transition ``F = [[1, 1], [0, 1]]``;
    observation ``H = [1, 0]``; process noise ``Q = diag(level_noise,
    slope_noise)``; observation noise ``R = obs_noise``. Predict:
    ``x = F x``, ``P = F P F' + Q``; update: ``S = H P H' + R``,
    ``K = P H' / S``, ``x = x + K (y - H x)``, ``P = (I - K H) P``. The
    forecast is ``H F x``. Equations: Durbin & Koopman, *Time Series Analysis
    by State Space Methods*, 2nd ed. (2012), sections 2.2 and 3.2 (local level
    and local linear trend models); Harvey, *Forecasting, Structural Time Series
    Models and the Kalman Filter* (1989), ch. 3.

    Only the ratios ``level_noise/obs_noise`` and ``slope_noise/obs_noise``
    matter: the gains do not depend on the data, so the filter is scale-free
    (request counts of 5 or 5000 behave alike). The state starts at the first
    observation (variance ``obs_noise``) with slope 0 and a diffuse slope
    variance (``1e6 * obs_noise``), so the second point sets the slope.

    Args:
        trend: model a slope (local linear trend) or not (local level).
        level_noise: level disturbance variance, relative to ``obs_noise``.
        slope_noise: slope disturbance variance, relative to ``obs_noise``.
        obs_noise: observation noise variance.
        window: observations kept in ``history`` (the filter itself is recursive
            and remembers everything through its state).
    """

    def __init__(self, trend: bool = True, level_noise: float = 0.1, slope_noise: float = 0.01,
                 obs_noise: float = 1.0, window: int = 64) -> None:
        super().__init__(window)
        if obs_noise <= 0 or level_noise < 0 or slope_noise < 0:
            raise ValueError("noise variances must be >= 0 (obs_noise > 0)")
        k = 2 if trend else 1
        self._F = np.array([[1.0, 1.0], [0.0, 1.0]])[:k, :k]
        self._Q = np.diag([level_noise, slope_noise][:k])
        self._R = float(obs_noise)
        self._x: np.ndarray | None = None
        self._P: np.ndarray | None = None

    def _on_observe(self, value: float) -> None:
        k = self._F.shape[0]
        if self._x is None:
            self._x = np.zeros(k)
            self._x[0] = value
            # Level known up to observation noise; slope unknown (diffuse).
            self._P = np.diag([self._R, 1e6 * self._R][:k])
            return
        x = self._F @ self._x
        P = self._F @ self._P @ self._F.T + self._Q
        S = P[0, 0] + self._R
        K = P[:, 0] / S
        x = x + K * (value - x[0])
        P = P - np.outer(K, P[0, :])
        self._x, self._P = x, P

    def _forecast(self) -> float:
        return float((self._F @ self._x)[0])

    def _forecast_ahead(self, steps: float) -> float:
        if self._x.shape[0] == 1:
            return float(self._x[0])
        return float(self._x[0] + steps * self._x[1])


class ProphetPredictor(LoadPredictor):
    """Facebook Prophet refitted on the window, with one point per ``interval_s``.

    Needs the optional ``prophet`` package (``pip install 'kvflow[prophet]'``).
    Returns the last value until ``min_points`` observations exist. Fits take
    ~0.1-1 s; use for adjustment intervals of a minute or more.

    Raises:
        ImportError: at construction, when ``prophet`` is not installed.
    """

    def __init__(self, interval_s: float = 60.0, min_points: int = 10, window: int = 256) -> None:
        try:
            import prophet  # noqa: F401
        except ImportError as exc:
            raise ImportError("the 'prophet' predictor needs the optional prophet package: "
                              "pip install 'kvflow[prophet]' (or choose constant, arima or kalman)") from exc
        super().__init__(window)
        self.interval_s = interval_s
        self.min_points = min_points

    def _forecast(self) -> float:
        if len(self.history) < self.min_points:
            return self.history[-1]
        import logging

        import pandas as pd
        from prophet import Prophet

        logging.getLogger("cmdstanpy").setLevel(logging.WARNING)
        ds = pd.date_range("2000-01-01", periods=len(self.history) + 1, freq=pd.Timedelta(seconds=self.interval_s))
        model = Prophet()
        model.fit(pd.DataFrame({"ds": ds[:-1], "y": list(self.history)}))
        return float(model.predict(pd.DataFrame({"ds": ds[-1:]}))["yhat"].iloc[0])


class MaxRecentPredictor(LoadPredictor):
    """The largest of the last ``lookback`` observations.

    Burst-aware: a rise is followed at once, a fall only after ``lookback``
    intervals, which is the scale-down hold a capacity planner wants anyway.
    It over-forecasts a falling series by design.

    Args:
        lookback: observations the maximum is taken over (>= 1).
        window: history kept (>= ``lookback``).
    """

    def __init__(self, lookback: int = 3, window: int = 64) -> None:
        if lookback < 1:
            raise ValueError("lookback must be >= 1")
        super().__init__(max(window, lookback))
        self.lookback = lookback

    def _forecast(self) -> float:
        return max(list(self.history)[-self.lookback:])


class QuantilePredictor(LoadPredictor):
    """The ``q`` quantile of the last ``lookback`` observations (numpy's linear interpolation).

    Between the mean and :class:`MaxRecentPredictor`: a single outlier
    interval moves it less than the maximum, a sustained rise as much.

    Args:
        q: quantile in [0, 1]. Defaults to 0.9.
        lookback: observations the quantile is taken over (>= 1). Defaults to 6.
        window: history kept (>= ``lookback``).
    """

    def __init__(self, q: float = 0.9, lookback: int = 6, window: int = 64) -> None:
        if not 0.0 <= q <= 1.0 or lookback < 1:
            raise ValueError("need 0 <= q <= 1 and lookback >= 1")
        super().__init__(max(window, lookback))
        self.q, self.lookback = q, lookback

    def _forecast(self) -> float:
        return float(np.quantile(np.fromiter(list(self.history)[-self.lookback:], dtype=float), self.q))


class BacktestPredictor(LoadPredictor):
    """Picks, every interval, the candidate whose recent one-step forecasts scored best.

    Every candidate sees every observation. Before an observation ``y`` is
    recorded, each candidate's standing forecast ``f`` is scored with an
    asymmetric loss: ``under_weight * (y - f)`` when it under-forecast
    (``f < y``: the pool would have been too small, the SLA pays) and
    ``f - y`` when it over-forecast (replica-hours pay). A candidate's score
    is its mean loss over the last ``lookback`` scored intervals (pinball
    loss of the ``under_weight / (1 + under_weight)`` quantile; Koenker and
    Bassett, "Regression quantiles", Econometrica 46(1), 1978). The forecast
    is the best-scoring candidate's; ties go to the earlier candidate, and
    before any score the first candidate answers.

    Args:
        candidates: predictor names (any in :data:`PREDICTORS` except ``backtest``),
            each built with its defaults. Defaults to constant, max_recent, quantile, kalman.
        under_weight: cost of one unit under-forecast relative to one unit
            over (>= 1). Defaults to 3: a 75th-percentile target, since a
            missed SLA costs more than an idle replica.
        lookback: scored intervals per candidate. Defaults to 10.
        window: history kept.

    Attributes:
        chosen: name of the candidate that made the last forecast.
    """

    def __init__(self, candidates: tuple[str, ...] = ("constant", "max_recent", "quantile", "kalman"),
                 under_weight: float = 3.0, lookback: int = 10, window: int = 64) -> None:
        if not candidates or "backtest" in candidates:
            raise ValueError("candidates must be a non-empty list of predictors other than backtest")
        if under_weight < 1 or lookback < 1:
            raise ValueError("need under_weight >= 1 and lookback >= 1")
        super().__init__(window)
        self.names = tuple(candidates)
        self.candidates = [make_predictor(n) for n in self.names]
        self.under_weight, self.lookback = under_weight, lookback
        self.losses: list[deque[float]] = [deque(maxlen=lookback) for _ in self.names]
        self.chosen = self.names[0]

    def _on_observe(self, value: float) -> None:
        for cand, losses in zip(self.candidates, self.losses):
            if cand.num_observations:
                f = cand.predict()
                losses.append(self.under_weight * (value - f) if f < value else f - value)
            cand.observe(value)

    def scores(self) -> dict[str, float | None]:
        """Mean recent loss per candidate name (None before it was scored)."""
        return {n: (sum(l) / len(l) if l else None) for n, l in zip(self.names, self.losses)}

    def _forecast(self) -> float:
        scored = [(sum(l) / len(l), i) for i, l in enumerate(self.losses) if l]
        best = min(scored)[1] if scored else 0
        self.chosen = self.names[best]
        return self.candidates[best].predict()

    def _forecast_ahead(self, steps: float) -> float:
        self._forecast()  # sets chosen
        return self.candidates[self.names.index(self.chosen)].predict_ahead(steps)


PREDICTORS: dict[str, type[LoadPredictor]] = {
    "constant": ConstantPredictor,
    "arima": ArimaPredictor,
    "kalman": KalmanPredictor,
    "prophet": ProphetPredictor,
    "max_recent": MaxRecentPredictor,
    "quantile": QuantilePredictor,
    "backtest": BacktestPredictor,
}
"""Predictor names accepted by :func:`make_predictor`."""


def make_predictor(name: str, **kwargs) -> LoadPredictor:
    """Build a predictor by name (a key of :data:`PREDICTORS`).

    ``kwargs`` go to the predictor's constructor (``window`` for all; see each class).

    Raises:
        ValueError: unknown name.
        ImportError: ``prophet`` without the optional package.
    """
    try:
        cls = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; choose one of {sorted(PREDICTORS)}") from None
    return cls(**kwargs)
