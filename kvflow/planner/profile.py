"""Engine profiles: latency and throughput per replica over (length, concurrency).

A :class:`Profile` is what the SLA planner interpolates
(:mod:`kvflow.planner.interpolation`). It holds two grids:

* **prefill** — for each ISL and each number of prompts prefilled together
  (concurrency): mean TTFT (ms) and prefill throughput per replica (new
  tokens/s);
* **decode** — for each context length and each number of sequences decoding
  together: ITL (ms per token), decode throughput per replica (output
  tokens/s) and the KV-cache usage it implies.

Grid cells an engine cannot run (more sequences than ``max_num_seqs``, or more
KV blocks than it has) are ``null`` in JSON / ``None`` here.

:func:`run_profile` fills a profile for the ``mocker`` engine by driving its
engine core (:class:`~kvflow.workers.engines.mocker_core.MockerCore`) on a
simulated clock: the profile is exactly what mocker workers do, including
chunked prefill and the decode term of the step that samples a first token.
Sweeping the ``hf`` and ``vllm`` engines is not implemented yet and raises
``NotImplementedError``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from kvflow.schemas import SamplingParams
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore

__all__ = [
    "PrefillProfile", "DecodeProfile", "Profile", "run_profile", "mocker_prefill_point", "mocker_decode_point",
    "DEFAULT_ISLS", "DEFAULT_CONCURRENCIES",
]

DEFAULT_ISLS: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""ISL / context-length axis of the default sweep, tokens."""
DEFAULT_CONCURRENCIES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Concurrency axis of the default sweep (sequences batched together)."""


Grid = list[list[float | None]]


def _check_axis(name: str, axis: Sequence[float]) -> None:
    if not axis:
        raise ValueError(f"{name} axis is empty")
    if any(v <= 0 for v in axis) or any(b <= a for a, b in zip(axis, axis[1:])):
        raise ValueError(f"{name} axis must be positive and strictly increasing: {list(axis)}")


def _check_grid(name: str, grid: Grid, rows: int, cols: int) -> None:
    if len(grid) != rows or any(len(r) != cols for r in grid):
        raise ValueError(f"{name} must be a {rows}x{cols} grid")


class PrefillProfile(BaseModel):
    """Prefill grid: ``ttft_ms[i][j]`` and ``throughput_tokens_per_s[i][j]`` at
    ``isl[i]`` tokens and ``concurrency[j]`` prompts batched together; ``None``
    where infeasible. Throughput counts new prompt tokens per second per replica.
    ``ttft_p99_ms`` (optional, same shape): the 99th percentile of the requests'
    TTFT where the sweep measured it (a planner targeting p99 TTFT sizes by it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    isl: list[int]
    concurrency: list[int]
    ttft_ms: Grid
    throughput_tokens_per_s: Grid
    ttft_p99_ms: Grid | None = None

    @model_validator(mode="after")
    def _shape(self) -> PrefillProfile:
        _check_axis("isl", self.isl)
        _check_axis("concurrency", self.concurrency)
        for name in ("ttft_ms", "throughput_tokens_per_s", "ttft_p99_ms"):
            if getattr(self, name) is not None:
                _check_grid(name, getattr(self, name), len(self.isl), len(self.concurrency))
        return self


class DecodeProfile(BaseModel):
    """Decode grid: ``itl_ms[i][j]``, ``throughput_tokens_per_s[i][j]`` and
    ``kv_usage[i][j]`` at ``context_length[i]`` tokens per sequence and
    ``concurrency[j]`` sequences; ``None`` where infeasible. Throughput counts
    output tokens per second per replica; KV usage is a fraction of blocks.
    ``itl_p99_ms`` (optional, same shape): the 99th percentile over requests of
    their mean ITL where the sweep measured it (a planner targeting p99 ITL
    sizes by it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_length: list[int]
    concurrency: list[int]
    itl_ms: Grid
    throughput_tokens_per_s: Grid
    kv_usage: Grid
    itl_p99_ms: Grid | None = None

    @model_validator(mode="after")
    def _shape(self) -> DecodeProfile:
        _check_axis("context_length", self.context_length)
        _check_axis("concurrency", self.concurrency)
        for name in ("itl_ms", "throughput_tokens_per_s", "kv_usage", "itl_p99_ms"):
            if getattr(self, name) is not None:
                _check_grid(name, getattr(self, name), len(self.context_length), len(self.concurrency))
        return self


class Profile(BaseModel):
    """An engine's measured (or modelled) performance, as stored in a profile JSON file.

    ``engine_config`` records the capacity settings the profile was taken with
    (block size, KV blocks, ...); a profile only describes replicas that run
    with the same settings.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = 1
    engine: str
    model: str = ""
    created_ms: int = 0
    engine_config: dict[str, Any] = {}
    prefill: PrefillProfile
    decode: DecodeProfile

    def save(self, path: Path | str) -> Path:
        """Write the profile as indented JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: Path | str) -> Profile:
        """Read a profile written by :meth:`save`.

        Raises:
            FileNotFoundError: no file at ``path``.
            pydantic.ValidationError: the file is not a valid profile.
        """
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


def _column(grid: list[list[tuple | None]], k: int) -> Grid:
    """Field ``k`` of every cell's tuple, keeping ``None`` cells."""
    return [[None if cell is None else cell[k] for cell in row] for row in grid]


def _blocks(config: MockerConfig, tokens: int) -> int:
    return -(-tokens // config.block_size)


def mocker_prefill_point(config: MockerConfig, isl: int, concurrency: int) -> tuple[float, float] | None:
    """Prefill ``concurrency`` prompts of ``isl`` tokens submitted together to a fresh mocker core.

    Each request asks for one output token; a request's TTFT is the simulated
    time at the end of the step that samples it.

    Returns:
        (mean TTFT ms, prompt tokens/s over the whole batch), or ``None`` when
        the batch cannot run at once (more than ``max_num_seqs`` sequences or
        KV blocks than the pool holds).
    """
    if concurrency > config.max_num_seqs or concurrency * _blocks(config, isl) > config.num_kv_blocks:
        return None
    core = MockerCore(config, worker_id="profile")
    sampling = SamplingParams(max_tokens=1)
    prompt = [1] * isl
    for i in range(concurrency):
        core.add_request(GenerateRequest(f"p{i}", prompt, sampling))
    now_ms, ttfts = 0.0, []
    while core.has_work():
        step = core.step()
        now_ms += step.duration_ms
        ttfts.extend([now_ms] * len(step.outputs))
    return sum(ttfts) / len(ttfts), isl * concurrency * 1000.0 / now_ms


def mocker_decode_point(config: MockerConfig, context_length: int, concurrency: int,
                        steps: int = 4) -> tuple[float, float, float] | None:
    """Decode ``concurrency`` sequences of about ``context_length`` tokens on a fresh mocker core.

    Prefills all prompts, then averages the duration of ``steps`` pure decode
    steps (every sequence samples one token, no prefill work).

    Returns:
        (ITL ms, output tokens/s, KV usage fraction during those steps), or
        ``None`` when the batch does not fit or the core preempted a sequence.
    """
    # Enough output tokens that no sequence finishes before the last one starts
    # decoding: prefill steps, whose budget running sequences share, plus `steps`.
    budget = max(1, config.max_num_batched_tokens - concurrency)
    max_tokens = -(-context_length * concurrency // budget) + steps + 2
    if (concurrency > config.max_num_seqs
            or concurrency * _blocks(config, context_length + max_tokens) > config.num_kv_blocks):
        return None
    core = MockerCore(config, worker_id="profile")
    sampling = SamplingParams(max_tokens=max_tokens)
    prompt = [1] * context_length
    for i in range(concurrency):
        core.add_request(GenerateRequest(f"d{i}", prompt, sampling))
    started: set[str] = set()
    while len(started) < concurrency:
        started.update(core.step().outputs)
    durations, usage = [], 0.0
    for _ in range(steps):
        step = core.step()
        if len(step.outputs) != concurrency or step.prefill_tokens:
            return None
        durations.append(step.duration_ms)
        usage = core.stats().used_blocks / config.num_kv_blocks
    if core.num_preemptions:
        return None
    itl = sum(durations) / len(durations)
    return itl, concurrency * 1000.0 / itl, usage


def _mocker_profile(isls: Sequence[int], concurrencies: Sequence[int], config: MockerConfig, model: str) -> Profile:
    prefill = [[mocker_prefill_point(config, isl, c) for c in concurrencies] for isl in isls]
    decode = [[mocker_decode_point(config, ctx, c) for c in concurrencies] for ctx in isls]
    return Profile(
        engine="mocker", model=model, created_ms=int(time.time() * 1000),
        engine_config=json.loads(json.dumps(asdict(config))),  # tuples -> lists, as a reload sees them
        prefill=PrefillProfile(
            isl=list(isls), concurrency=list(concurrencies),
            ttft_ms=_column(prefill, 0), throughput_tokens_per_s=_column(prefill, 1),
        ),
        decode=DecodeProfile(
            context_length=list(isls), concurrency=list(concurrencies),
            itl_ms=_column(decode, 0), throughput_tokens_per_s=_column(decode, 1), kv_usage=_column(decode, 2),
        ),
    )


def run_profile(engine: str = "mocker", isls: Sequence[int] = DEFAULT_ISLS,
                concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES, out_path: Path | str | None = None,
                *, model: str = "mocker", config: MockerConfig | None = None) -> Profile:
    """Sweep an engine over ISL x concurrency and return (and optionally save) its profile.

    ``isls`` is used both as the prefill ISL axis and as the decode
    context-length axis. For ``engine="mocker"`` every grid point runs a fresh
    :class:`~kvflow.workers.engines.mocker_core.MockerCore` on a simulated
    clock (the default grid takes well under a second of CPU). Prefix caching
    is switched off for the sweep so that every prompt token is computed.

    Args:
        engine: ``"mocker"`` (``"hf"`` and ``"vllm"``: see
            :func:`kvflow.planner.engine_sweep.profile_engine`).
        isls: ascending token counts.
        concurrencies: ascending sequence counts.
        out_path: where to write the JSON (parents created); ``None`` to skip.
        model: model name recorded in the profile.
        config: mocker settings (capacity, step-time coefficients, speedup);
            defaults to ``MockerConfig()``.

    Raises:
        ValueError: ``engine`` is not ``"mocker"``, or axes not positive and strictly increasing.
    """
    if engine in ("hf", "vllm"):
        raise ValueError(
            f"the {engine!r} engine is timed live, not simulated: use "
            f"kvflow.planner.engine_sweep.profile_engine (`kvflow profile --engine {engine}`)")
    if engine != "mocker":
        raise ValueError(f"unknown engine {engine!r}; choose mocker, hf or vllm")
    for name, axis in (("isls", isls), ("concurrencies", concurrencies)):
        _check_axis(name, axis)
    config = replace(config or MockerConfig(), enable_prefix_caching=False)
    profile = _mocker_profile(list(isls), list(concurrencies), config, model)
    if out_path is not None:
        profile.save(out_path)
    return profile
