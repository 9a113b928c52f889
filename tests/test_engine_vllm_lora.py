"""LoRA on the ``vllm`` engine: the adapter trained for a few steps on SmolLM2-135M-Instruct
(as in tests/test_engine_hf_lora.py), served through vLLM's LoRA API (CPU build in CI)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvflow.schemas import BlockStored, ChatMessage, SamplingParams
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.workers.engines.base import EngineError, GenerateRequest
from kvflow.workers.engines.capabilities import ServesLora

from test_engine_hf_lora import QUESTION, train_adapter
from vllm_support import TEST_KV_CACHE_GB, require_vllm

# vLLM engines start in ~20 s on a quiet CPU and several times that on a loaded one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model_dir():
    require_vllm()
    from kvflow.models.resolve import resolve_model

    return resolve_model("SmolLM2-135M-Instruct").path


@pytest.fixture(scope="module")
async def engine(model_dir):
    """An eager float32 engine started with room for two adapters of rank <= 8."""
    from kvflow.workers.engines.vllm import VllmEngine, VllmOptions

    eng = VllmEngine(model=str(model_dir), options=VllmOptions(kv_cache_gb=TEST_KV_CACHE_GB, dtype="float32",
                                                               compiled=False, max_loras=2, max_lora_rank=8),
                     extra={"max_model_len": 1024})
    eng.test_events = []
    eng.kv_event_sink = eng.test_events.extend
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    from kvflow.models.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir)).encode_chat([ChatMessage(role="user", content=QUESTION)])


@pytest.fixture(scope="module")
async def adapter_dir(prompt, tmp_path_factory) -> Path:
    return await asyncio.to_thread(train_adapter, tmp_path_factory.mktemp("lora") / "bananas", prompt)


async def run(eng, rid: str, prompt: list[int], lora: str | None = None) -> list[int]:
    outs = [o async for o in eng.generate(GenerateRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                                                     ignore_eos=True),
                                                          lora_name=lora))]
    return [t for o in outs for t in o.token_ids]


async def _stored_events(eng, lora_name: str | None, timeout_s: float = 60.0) -> list[BlockStored]:
    """The BlockStored events of ``lora_name`` received so far, waiting until there is one
    (vLLM publishes them from its engine core, a moment after the request ends)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = [e for e in eng.test_events if isinstance(e, BlockStored) and e.lora_name == lora_name]
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(0.05)


async def test_vllm_adapter_changes_output_and_hashes_its_own_blocks(engine, prompt, adapter_dir, model_dir):
    from kvflow.models.tokenizer import load_tokenizer

    assert isinstance(engine, ServesLora)
    base = await run(engine, "base-1", prompt)
    await engine.load_lora("bananas", adapter_dir)
    assert engine.lora_names == ["bananas"]
    with pytest.raises(EngineError, match="already loaded"):
        await engine.load_lora("bananas", adapter_dir)

    tuned = await run(engine, "lora-1", prompt, "bananas")
    assert tuned != base and "Banana" in load_tokenizer(str(model_dir)).decode(tuned)
    # Its KV events carry the adapter's name and hash apart from the base model's blocks of the prompt.
    stored = await _stored_events(engine, "bananas")
    hashes = {h for e in stored for h in e.block_hashes}
    assert hashes and not hashes & set(compute_block_hashes(prompt + base, engine.block_size))
    assert hashes <= set(compute_block_hashes(prompt + tuned, engine.block_size, "bananas"))

    # Base and adapter requests in one batch each keep their own output.
    both = await asyncio.gather(run(engine, "mix-base", prompt), run(engine, "mix-lora", prompt, "bananas"))
    assert both == [base, tuned]

    await engine.unload_lora("bananas")
    assert engine.lora_names == []
    with pytest.raises(EngineError, match="not loaded"):
        await run(engine, "lora-2", prompt, "bananas")
    assert await run(engine, "base-2", prompt) == base


async def test_vllm_without_lora_refuses_adapters(model_dir, tmp_path):
    from kvflow.workers.engines.vllm import VllmEngine, vllm_engine_args, VllmOptions
    from kvflow.workers.engines.base import EngineConfig

    args, _ = vllm_engine_args(EngineConfig(), VllmOptions(max_loras=2, max_lora_rank=8), device_type="cpu",
                               arg_names=set())
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 2, 8)
    args, _ = vllm_engine_args(EngineConfig(), VllmOptions(), device_type="cpu", arg_names=set())
    assert "enable_lora" not in args
    eng = VllmEngine(model=str(model_dir))
    with pytest.raises(EngineError, match="started engine"):
        await eng.load_lora("x", tmp_path)
