"""Turn a profile into per-replica capacity under a latency target.

A profile grid gives, at each (length, concurrency) point, a latency (TTFT for
prefill, ITL for decode) and a per-replica throughput (tokens/s). For a
length between profiled points, both are interpolated linearly along the
length axis, then linearly along the concurrency axis at ``refine`` evenly
spaced steps between adjacent profiled concurrencies (bilinear interpolation
on the grid, evaluated on a finer concurrency grid).

Two questions are answered:

* :meth:`LatencySurface.best` — the highest per-replica throughput whose
  latency meets a target (the operating point the planner sizes pools by);
* :meth:`LatencySurface.latency_at_throughput` — the latency the profile
  expects at a given per-replica load (the denominator of the planner's
  correction factor).

An aggregated replica's capacity also depends on the traffic's mean output
length (each request's prefill interrupts the decode steps of the others;
see :class:`PerfFamily`): profiles taken at several mean OSLs form a
:class:`PerfFamily`, and the planner asks it for the model at the OSL it
observes (:meth:`PerfFamily.at_osl`; a single :class:`PerfModel` answers
for every OSL).

Clamping: a length outside the profiled range is clamped to the nearest
profiled length (no extrapolation, so an ISL twice the longest profiled one is
treated as the longest). Loads below the lowest profiled concurrency's
throughput get that point's latency; loads above the best throughput get the
latency at the best throughput. Infeasible grid cells (``None``) are never
chosen, and an interpolated point next to one is infeasible too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import math

import numpy as np

from kvflow.planner.profile import Profile

__all__ = ["OperatingPoint", "LatencySurface", "PerfModel", "PerfFamily", "PerfSource", "blend_surfaces", "perf_source"]


@dataclass(frozen=True)
class OperatingPoint:
    """One replica's operating point: ``concurrency`` sequences in flight give
    ``latency_ms`` and ``throughput_tokens_per_s``; ``meets_target`` is false when
    no feasible point met the target (then this is the lowest-latency point)."""

    concurrency: float
    latency_ms: float
    throughput_tokens_per_s: float
    meets_target: bool


def _grid(values: Sequence[Sequence[float | None]]) -> np.ndarray:
    return np.array([[np.nan if v is None else float(v) for v in row] for row in values], dtype=float)


class LatencySurface:
    """Latency and throughput over a (length, concurrency) grid, interpolated linearly.

    Args:
        lengths: ascending lengths (ISL or context length), tokens; shape [L].
        concurrency: ascending concurrencies; shape [C].
        latency_ms: grid [L][C], ``None`` where infeasible.
        throughput_tokens_per_s: grid [L][C], ``None`` where infeasible.
        refine: evaluation steps between adjacent profiled concurrencies.

    Raises:
        ValueError: shapes disagree, axes not increasing, or ``refine < 1``.
    """

    def __init__(self, lengths: Sequence[float], concurrency: Sequence[float],
                 latency_ms: Sequence[Sequence[float | None]],
                 throughput_tokens_per_s: Sequence[Sequence[float | None]], refine: int = 16) -> None:
        self.lengths = np.asarray(lengths, dtype=float)
        self.concurrency = np.asarray(concurrency, dtype=float)
        self.latency = _grid(latency_ms)
        self.throughput = _grid(throughput_tokens_per_s)
        shape = (len(self.lengths), len(self.concurrency))
        if self.latency.shape != shape or self.throughput.shape != shape:
            raise ValueError(f"grids must have shape {shape}")
        if np.any(np.diff(self.lengths) <= 0) or np.any(np.diff(self.concurrency) <= 0):
            raise ValueError("lengths and concurrency must be strictly increasing")
        if refine < 1:
            raise ValueError("refine must be >= 1")
        self.refine = refine

    def _row(self, length: float) -> tuple[np.ndarray, np.ndarray]:
        """Latency and throughput at ``length`` (clamped) for every profiled concurrency."""
        x = float(np.clip(length, self.lengths[0], self.lengths[-1]))
        i = int(np.searchsorted(self.lengths, x, side="right")) - 1
        if i >= len(self.lengths) - 1 or self.lengths[i] == x:
            i = min(i, len(self.lengths) - 1)
            return self.latency[i].copy(), self.throughput[i].copy()
        w = (x - self.lengths[i]) / (self.lengths[i + 1] - self.lengths[i])
        return ((1 - w) * self.latency[i] + w * self.latency[i + 1],
                (1 - w) * self.throughput[i] + w * self.throughput[i + 1])

    def curve(self, length: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Concurrency, latency (ms) and throughput (tokens/s) along the refined
        concurrency grid at ``length``; each of shape [(C-1)*refine + 1]; NaN where infeasible."""
        lat, thr = self._row(length)
        if len(self.concurrency) == 1:
            return self.concurrency.copy(), lat, thr
        w = np.arange(self.refine) / self.refine
        def fine(v: np.ndarray) -> np.ndarray:
            inner = (1 - w)[None, :] * v[:-1, None] + w[None, :] * v[1:, None]
            # An exact profiled point stays valid even when its neighbour is infeasible.
            inner[:, 0] = v[:-1]
            return np.concatenate([inner.ravel(), v[-1:]])
        return fine(self.concurrency), fine(lat), fine(thr)

    def best(self, length: float, latency_target_ms: float) -> OperatingPoint:
        """Highest throughput at ``length`` whose latency is at most ``latency_target_ms``.

        Raises:
            ValueError: the profile has no feasible point at this length.
        """
        conc, lat, thr = self.curve(length)
        valid = _feasible(lat, thr, length)
        ok = valid & (lat <= latency_target_ms)
        if ok.any():
            k = int(np.argmax(np.where(ok, thr, -np.inf)))
            return OperatingPoint(float(conc[k]), float(lat[k]), float(thr[k]), True)
        k = int(np.argmin(np.where(valid, lat, np.inf)))
        return OperatingPoint(float(conc[k]), float(lat[k]), float(thr[k]), False)

    def max_throughput(self, length: float) -> float:
        """Peak feasible per-replica throughput at ``length``, tokens/s.

        Raises:
            ValueError: the profile has no feasible point at this length.
        """
        _, lat, thr = self.curve(length)
        valid = _feasible(lat, thr, length)
        return float(thr[valid].max())

    def latency_at_throughput(self, length: float, tokens_per_s: float) -> float:
        """Latency the profile expects when one replica serves ``tokens_per_s`` at ``length``.

        Walks the refined curve in increasing concurrency up to the peak
        throughput and interpolates latency linearly in throughput; clamps
        below the first and above the peak point (see module docstring).

        Raises:
            ValueError: the profile has no feasible point at this length.
        """
        conc, lat, thr = self.curve(length)
        valid = _feasible(lat, thr, length)
        lat, thr = lat[valid], thr[valid]
        peak = int(np.argmax(thr))
        lat, thr = lat[: peak + 1], thr[: peak + 1]
        # Running max makes throughput non-decreasing for the inversion.
        thr = np.maximum.accumulate(thr)
        return float(np.interp(tokens_per_s, thr, lat))


@dataclass(frozen=True)
class PerfModel:
    """Prefill and decode surfaces of one engine profile.

    ``prefill``: lengths are ISL (new tokens per prompt), latency is TTFT,
    throughput counts prompt tokens/s per replica. ``decode``: lengths are
    context length per sequence, latency is ITL, throughput counts output
    tokens/s per replica.
    """

    prefill: LatencySurface
    decode: LatencySurface

    @classmethod
    def from_profile(cls, profile: Profile, refine: int = 16, *, ttft_statistic: str = "mean",
                     itl_statistic: str = "mean") -> PerfModel:
        """Build both surfaces from a :class:`~kvflow.planner.profile.Profile`.

        ``ttft_statistic`` / ``itl_statistic`` ``"p99"`` take the latency
        grids of the requests' 99th percentile (``ttft_p99_ms`` /
        ``itl_p99_ms``) where the profile has them, so a planner targeting the
        p99 compares like with like (its correction factor is then observed
        p99 / profiled p99, near 1 before it learnt anything, instead of
        observed p99 / profiled mean); without them, the mean grids.
        """
        p, d = profile.prefill, profile.decode
        ttft = p.ttft_p99_ms if ttft_statistic == "p99" and p.ttft_p99_ms is not None else p.ttft_ms
        itl = d.itl_p99_ms if itl_statistic == "p99" and d.itl_p99_ms is not None else d.itl_ms
        return cls(
            prefill=LatencySurface(p.isl, p.concurrency, ttft, p.throughput_tokens_per_s, refine),
            decode=LatencySurface(d.context_length, d.concurrency, itl, d.throughput_tokens_per_s, refine),
        )

    def at_osl(self, osl: float | None) -> PerfModel:
        """The model for traffic of mean output length ``osl``: one profile answers for every OSL."""
        return self


def blend_surfaces(a: LatencySurface, b: LatencySurface, w: float) -> LatencySurface:
    """``(1 - w) * a + w * b``, cell by cell, lengths included (row ``i`` of both must
    describe the same prompt length); a cell infeasible in either is infeasible.

    Raises:
        ValueError: the grids' shapes or concurrency axes differ, or ``w`` is outside [0, 1].
    """
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"blend weight must be in [0, 1], got {w}")
    if a.latency.shape != b.latency.shape or not np.array_equal(a.concurrency, b.concurrency):
        raise ValueError("surfaces to blend need the same grid shape and concurrency axis")
    out = LatencySurface.__new__(LatencySurface)
    out.lengths = (1 - w) * a.lengths + w * b.lengths
    out.concurrency = a.concurrency.copy()
    out.latency = (1 - w) * a.latency + w * b.latency
    out.throughput = (1 - w) * a.throughput + w * b.throughput
    out.refine = a.refine
    return out


class PerfFamily:
    """Perf models of one engine profiled at several mean output lengths.

    An aggregated replica interleaves prefill steps with decode steps: every
    request adds one prefill to the steps the running sequences decode in,
    so the prefill work per output token is ``1 / OSL`` prompts, and the ITL
    and throughput a replica reaches depend on the traffic's mean OSL, not
    only on ISL and concurrency. On the mocker's step-time model
    (:mod:`kvflow.workers.engines.mocker_core`: a step costs its prefill time
    plus its decode time) a 2,000-token prompt adds about 190 ms to one step;
    at 40 output tokens per request that is about 5 ms per output token, at
    256 under 1 ms. A profile taken at one OSL therefore misjudges decode
    capacity for traffic of another OSL several times over (measured:
    at ISL 2,048 and ITL 50 ms, about 75 output tokens/s per replica at OSL 40
    against about 450 at OSL 256), which no bounded correction factor covers.

    :meth:`at_osl` answers with the model at the traffic's mean OSL: the two
    profiles whose OSLs bracket it are blended cell by cell, linearly in
    ``log(OSL)`` (prefill interruptions per output token scale as ``1/OSL``,
    so equal ratios of OSL are equal steps); an OSL outside the profiled range
    takes the nearest profile (no extrapolation). Blends are cached on a
    grid of 1% steps of OSL, so a planner asking every second builds few.

    Args:
        models: ``(mean OSL, model)`` pairs, any order; all prefill grids and
            all decode grids of one shape and concurrency axis, and row ``i``
            of each describing the same prompt length (as
            :func:`kvflow.replay.planner_eval.aggregated_mocker_profile` makes them).

    Raises:
        ValueError: no model, a non-positive or repeated OSL, or grids that differ in shape.
    """

    _STEP = math.log(1.01)  # cache resolution of log(OSL)

    def __init__(self, models: Sequence[tuple[float, PerfModel]]) -> None:
        pairs = sorted((float(o), m) for o, m in models)
        if not pairs:
            raise ValueError("a PerfFamily needs at least one model")
        osls = [o for o, _ in pairs]
        if osls[0] <= 0 or len(set(osls)) != len(osls):
            raise ValueError(f"OSLs must be positive and distinct: {osls}")
        for _, m in pairs[1:]:
            for name in ("prefill", "decode"):
                x, y = getattr(pairs[0][1], name), getattr(m, name)
                if x.latency.shape != y.latency.shape or not np.array_equal(x.concurrency, y.concurrency):
                    raise ValueError(f"{name} grids differ in shape or concurrency axis across OSLs")
        self.osls = osls
        self.models = [m for _, m in pairs]
        self._cache: dict[int, PerfModel] = {}

    @classmethod
    def from_profiles(cls, profiles: Sequence[Profile], refine: int = 16, *, ttft_statistic: str = "mean",
                      itl_statistic: str = "mean") -> PerfFamily:
        """A family from profiles recording their mean OSL in ``engine_config["osl"]``
        (statistics as :meth:`PerfModel.from_profile`).

        Raises:
            ValueError: a profile without ``osl``, or as the constructor.
        """
        models = []
        for p in profiles:
            osl = p.engine_config.get("osl")
            if osl is None:
                raise ValueError(f"profile {p.model!r} records no mean OSL (engine_config['osl'])")
            models.append((float(osl), PerfModel.from_profile(p, refine, ttft_statistic=ttft_statistic,
                                                              itl_statistic=itl_statistic)))
        return cls(models)

    @property
    def prefill(self) -> LatencySurface:
        """Prefill surface of the median-OSL model (for callers that know no OSL)."""
        return self.models[len(self.models) // 2].prefill

    @property
    def decode(self) -> LatencySurface:
        """Decode surface of the median-OSL model (for callers that know no OSL)."""
        return self.models[len(self.models) // 2].decode

    def at_osl(self, osl: float | None) -> PerfModel:
        """The model at mean output length ``osl`` tokens (None: the median-OSL model)."""
        if osl is None or osl <= 0:
            return self.models[len(self.models) // 2]
        if osl <= self.osls[0]:
            return self.models[0]
        if osl >= self.osls[-1]:
            return self.models[-1]
        key = round(math.log(osl) / self._STEP)
        hit = self._cache.get(key)
        if hit is None:
            x = math.exp(key * self._STEP)
            j = int(np.searchsorted(self.osls, x, side="right"))
            j = min(max(j, 1), len(self.osls) - 1)
            lo, hi = self.osls[j - 1], self.osls[j]
            w = min(1.0, max(0.0, math.log(x / lo) / math.log(hi / lo)))
            a, b = self.models[j - 1], self.models[j]
            hit = PerfModel(prefill=blend_surfaces(a.prefill, b.prefill, w),
                            decode=blend_surfaces(a.decode, b.decode, w))
            self._cache[key] = hit
        return hit


PerfSource = PerfModel | PerfFamily
"""What the planner sizes with: one profile, or profiles at several mean OSLs."""


def _feasible(lat: np.ndarray, thr: np.ndarray, length: float) -> np.ndarray:
    """Mask of profile points with both a latency and a throughput.

    Raises:
        ValueError: no point is feasible at ``length``.
    """
    valid = ~np.isnan(lat) & ~np.isnan(thr)
    if not valid.any():
        raise ValueError(f"profile has no feasible point at length {length}")
    return valid


def perf_source(profiles: Profile | Sequence[Profile], refine: int = 16, *, ttft_statistic: str = "mean",
                itl_statistic: str = "mean") -> PerfSource:
    """The planner's model of one profile (:class:`PerfModel`), or of several taken at
    different mean OSLs (:class:`PerfFamily`; a list of one is that profile's model),
    read at the planner's latency statistics (``"p99"``: the p99 grids where present).

    Raises:
        ValueError: no profiles, or several and one records no mean OSL (``engine_config["osl"]``).
    """
    stats = {"ttft_statistic": ttft_statistic, "itl_statistic": itl_statistic}
    if isinstance(profiles, Profile):
        return PerfModel.from_profile(profiles, refine, **stats)
    profiles = list(profiles)
    if not profiles:
        raise ValueError("no profiles to plan with")
    if len(profiles) == 1:
        return PerfModel.from_profile(profiles[0], refine, **stats)
    return PerfFamily.from_profiles(profiles, refine, **stats)
