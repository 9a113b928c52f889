"""Profile a live engine (``hf``, ``vllm``): drive it through ISL x concurrency and time it.

The mocker is profiled on a simulated clock (:mod:`kvflow.planner.profile`);
a real engine can only be timed. :func:`sweep_engine` takes a started
:class:`~kvflow.workers.engines.base.Engine` and measures, on the wall clock
(``time.perf_counter``), the two grids of a
:class:`~kvflow.planner.profile.Profile`:

* **prefill** point (ISL, c): ``c`` prompts of ISL tokens submitted at once,
  one output token each. TTFT of a request = time from submission to its
  first token; the cell holds the mean TTFT (ms) and ``ISL · c / t_last``
  prompt tokens/s, ``t_last`` being the TTFT of the last request.
* **decode** point (context, c): ``c`` prompts of ``context`` tokens decoding
  together. The steady window starts when the last request has its first
  token (every sequence is decoding) and ends when the first request
  finishes (none has left). ITL = mean gap between consecutive outputs of a
  request inside the window, divided by the tokens the later output carries;
  throughput = output tokens produced inside the window / its duration;
  KV usage = the share of the engine's KV blocks the ``c`` sequences imply
  at their longest, ``c · ceil((context + max_tokens) / block_size) /
  total_blocks`` (None when the engine reports no pool). It is computed, not
  sampled: engines count cached blocks differently (hf counts its whole
  prefix cache as used, which a sweep fills). The planner does not read it.

Prompts are random token ids (seeded), distinct for every request, so no
point profits from the prefix cache. Requests ask for ``ignore_eos`` and
``temperature = 0`` so each runs to its ``max_tokens``. One warm-up request
runs first (first-call costs: allocator, kernel selection). A point whose
prompt plus output exceeds the engine's ``context_length``, that the engine
rejects (:class:`~kvflow.workers.engines.base.EngineError`), or whose decode
window is empty is ``None``.

Wall-clock numbers depend on the host and its load: the profile is only as
good as the quiet of the machine it was taken on.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvflow.planner.profile import DecodeProfile, PrefillProfile, Profile
from kvflow.schemas import SamplingParams
from kvflow.workers.engines.base import Engine, EngineError, GenerateRequest

__all__ = ["SweepConfig", "sweep_engine", "profile_engine", "prefill_point", "decode_point"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SweepConfig:
    """How a live sweep runs.

    Attributes:
        decode_tokens: output tokens each sequence produces inside the
            decode window (more: steadier ITL, longer sweep). Defaults to 16.
        token_range: prompt token ids are drawn uniformly from
            ``[low, high)``; keep it inside the model's vocabulary.
            Defaults to ``(1000, 30000)``.
        seed: seed of the prompt generator. Defaults to 0.
        prefill_budget_tokens: assumed prompt tokens an engine prefills per
            step; sizes the extra output tokens a decode point asks for so
            no sequence finishes before the last one starts decoding.
            Defaults to 512 (below vLLM's and kvflow hf's default budgets,
            so the margin errs long).
    """

    decode_tokens: int = 16
    token_range: tuple[int, int] = (1000, 30000)
    seed: int = 0
    prefill_budget_tokens: int = 512

    def __post_init__(self) -> None:
        if self.decode_tokens < 2:
            raise ValueError("decode_tokens must be >= 2")
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"bad token_range {self.token_range}")


@dataclass
class _Prompts:
    """Distinct random prompts (no two requests share a first block)."""

    config: SweepConfig
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.config.seed)

    def take(self, length: int) -> list[int]:
        low, high = self.config.token_range
        return [self.rng.randrange(low, high) for _ in range(length)]


def _fits(engine: Engine, tokens: int) -> bool:
    return engine.context_length is None or tokens <= engine.context_length


def _request(tag: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(f"profile-{tag}-{uuid.uuid4().hex[:8]}", prompt, sampling)


async def prefill_point(engine: Engine, prompts: Sequence[list[int]]) -> tuple[float, float] | None:
    """Submit ``prompts`` (all the same length) at once for one token each.

    Returns:
        (mean TTFT ms, prompt tokens/s over the batch), or None when the
        engine rejects a request or the prompt does not fit its context.
    """
    isl = len(prompts[0])
    if not _fits(engine, isl + 1):
        return None
    started = time.perf_counter()
    ttfts: list[float] = []

    async def one(prompt: list[int]) -> None:
        async for out in engine.generate(_request("p", prompt, 1)):
            if out.token_ids:
                ttfts.append(time.perf_counter() - started)
                break

    try:
        await asyncio.gather(*(one(p) for p in prompts))
    except EngineError:
        return None
    if len(ttfts) != len(prompts):
        return None
    return sum(ttfts) / len(ttfts) * 1000.0, isl * len(prompts) / max(ttfts)


async def decode_point(engine: Engine, prompts: Sequence[list[int]],
                       config: SweepConfig = SweepConfig()) -> tuple[float, float, float | None] | None:
    """Decode ``prompts`` (all the same length) together; see the module docstring.

    Returns:
        (ITL ms, output tokens/s, implied KV usage fraction or None), or None
        when the engine rejects a request, the sequences do not fit its
        context, or the steady window is empty.
    """
    ctx, c = len(prompts[0]), len(prompts)
    max_tokens = config.decode_tokens + -(-ctx * c // config.prefill_budget_tokens) + 2
    if not _fits(engine, ctx + max_tokens):
        return None
    stamps: list[list[tuple[float, int]]] = [[] for _ in prompts]

    async def one(i: int, prompt: list[int]) -> None:
        async for out in engine.generate(_request("d", prompt, max_tokens)):
            if out.token_ids:
                stamps[i].append((time.perf_counter(), len(out.token_ids)))

    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    except EngineError:
        return None
    if any(not s for s in stamps):
        return None
    t0 = max(s[0][0] for s in stamps)  # every sequence is decoding from here
    t1 = min(s[-1][0] for s in stamps)  # ... until the first one ends
    if t1 <= t0:
        return None
    tokens, gaps = 0, []
    for s in stamps:
        inside = [(t, n) for t, n in s if t0 < t <= t1]
        tokens += sum(n for _, n in inside)
        window = [(t, n) for t, n in s if t0 <= t <= t1]
        gaps.extend((b - a) / n for (a, _), (b, n) in zip(window, window[1:]))
    if not gaps or not tokens:
        return None
    stats = engine.kv_stats()
    usage = c * -(-(ctx + max_tokens) // stats.block_size) / stats.total_blocks if stats.total_blocks else None
    return sum(gaps) / len(gaps) * 1000.0, tokens / (t1 - t0), usage


async def sweep_engine(engine: Engine, isls: Sequence[int], concurrencies: Sequence[int], *,
                       config: SweepConfig = SweepConfig(), model: str | None = None,
                       engine_config: dict | None = None, progress: Progress | None = None) -> Profile:
    """Sweep a started ``engine`` over ``isls`` x ``concurrencies``; see the module docstring.

    ``isls`` is both the prefill ISL axis and the decode context-length axis.
    ``engine_config`` is recorded in the profile (the settings it describes);
    ``progress`` receives one line per grid point.

    Raises:
        ValueError: an axis is empty, not positive or not strictly increasing.
        EngineError: the warm-up request failed (the engine does not serve at all).
    """
    for name, axis in (("isls", isls), ("concurrencies", concurrencies)):
        if not axis or any(v <= 0 for v in axis) or any(b <= a for a, b in zip(axis, axis[1:])):
            raise ValueError(f"{name} axis must be positive and strictly increasing: {list(axis)}")
    gen = _Prompts(config)
    async for _ in engine.generate(_request("warmup", gen.take(min(isls)), 2)):
        pass
    say = progress or (lambda _line: None)
    prefill: list[list[tuple | None]] = []
    for isl in isls:
        row = []
        for c in concurrencies:
            row.append(await prefill_point(engine, [gen.take(isl) for _ in range(c)]))
            say(f"prefill isl={isl} c={c}: {_fmt(row[-1])}")
        prefill.append(row)
    decode: list[list[tuple | None]] = []
    for ctx in isls:
        row = []
        for c in concurrencies:
            row.append(await decode_point(engine, [gen.take(ctx) for _ in range(c)], config))
            say(f"decode ctx={ctx} c={c}: {_fmt(row[-1])}")
        decode.append(row)
    stats = engine.kv_stats()
    recorded = {"block_size": stats.block_size, "kv_total_blocks": stats.total_blocks,
                "context_length": engine.context_length, "decode_tokens": config.decode_tokens,
                **(engine_config or {})}

    def col(grid: list[list[tuple | None]], k: int) -> list[list[float | None]]:
        return [[None if cell is None or cell[k] is None else float(cell[k]) for cell in r] for r in grid]

    return Profile(
        engine=engine.name, model=model or engine.model_name, created_ms=int(time.time() * 1000),
        engine_config=recorded,
        prefill=PrefillProfile(isl=list(isls), concurrency=list(concurrencies),
                               ttft_ms=col(prefill, 0), throughput_tokens_per_s=col(prefill, 1)),
        decode=DecodeProfile(context_length=list(isls), concurrency=list(concurrencies),
                             itl_ms=col(decode, 0), throughput_tokens_per_s=col(decode, 1), kv_usage=col(decode, 2)),
    )


def _fmt(cell: tuple | None) -> str:
    if cell is None:
        return "infeasible"
    return ", ".join("-" if v is None else f"{v:.4g}" for v in cell)


async def profile_engine(engine: str, model: str, isls: Sequence[int], concurrencies: Sequence[int], *,
                         config: SweepConfig = SweepConfig(), block_size: int | None = None,
                         num_kv_blocks: int | None = None, device: str = "cpu",
                         vllm_options: dict | None = None, progress: Progress | None = None) -> Profile:
    """Build ``engine`` (``hf`` or ``vllm``) for ``model`` as a worker would
    (:func:`kvflow.workers.main.build_engine`), start it, :func:`sweep_engine`, stop it.

    ``vllm_options`` are ``build_engine``'s vllm keywords (``kv_cache_gb``,
    ``dtype``, ``compiled``); they and the engine's own arguments are recorded
    in the profile's ``engine_config``.

    Raises:
        ValueError: unknown or simulated engine (``mocker``: use
            :func:`kvflow.planner.profile.run_profile`), or bad axes.
        EngineError: the engine failed to start or to serve.
    """
    if engine not in ("hf", "vllm"):
        raise ValueError(f"live profiling needs a real engine (hf or vllm), not {engine!r}")
    from kvflow.workers.main import build_engine

    options = (vllm_options or {}) if engine == "vllm" else {}
    eng, served, _tokenizer = build_engine(engine, model, block_size=block_size, num_kv_blocks=num_kv_blocks,
                                           device=device, worker_id="profile", **options)
    await eng.start()
    try:
        settings = {"device": device, **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {}), **options}
        engine_args = getattr(eng, "engine_args", None)  # vllm: what vLLM was given
        if engine_args:
            settings["vllm_engine_args"] = {k: v for k, v in engine_args.items()
                                            if isinstance(v, (int, float, str, bool))}
        return await sweep_engine(eng, isls, concurrencies, config=config, model=served, engine_config=settings,
                                  progress=progress)
    finally:
        await eng.stop()
