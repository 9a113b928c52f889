"""LoRA on the ``hf`` engine: a real adapter trained for a few steps on SmolLM2-135M-Instruct (CPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvflow.models.resolve import resolve_model
from kvflow.schemas import BlockStored, ChatMessage, SamplingParams
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.workers.engines.base import EngineConfig, EngineError, GenerateRequest
from kvflow.workers.engines.capabilities import ServesLora
from kvflow.workers.engines.hf import HfEngine
from kvflow.workers.lora import AdapterManager

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one short sentence, please."
TARGET = " Bananas are yellow. Bananas are yellow. Bananas are yellow."


def train_adapter(out: Path, prompt: list[int], steps: int = 12) -> Path:
    """Train a rank-8 LoRA on q/v projections for ``steps`` AdamW steps to answer ``prompt``
    with ``TARGET``; save it with peft to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(resolve_model(EngineConfig().model).path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    target = tok(TARGET, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])  # loss on the answer only
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
async def engine():
    eng = HfEngine(EngineConfig(num_kv_blocks=256))
    events: list = []
    eng.kv_event_sink = events.extend
    await eng.start()
    eng.test_events = events
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode_chat([ChatMessage(role="user", content=QUESTION)])


@pytest.fixture(scope="module")
async def adapter_dir(prompt, tmp_path_factory) -> Path:
    return await asyncio.to_thread(train_adapter, tmp_path_factory.mktemp("lora") / "bananas", prompt)


async def run(eng: HfEngine, rid: str, prompt: list[int], lora: str | None = None, max_tokens: int = 10):
    """Greedy request; returns (tokens, num_cached_tokens of the first output)."""
    outs = [o async for o in eng.generate(GenerateRequest(rid, prompt, SamplingParams(temperature=0.0,
                                                                                     max_tokens=max_tokens,
                                                                                     ignore_eos=True),
                                                          lora_name=lora))]
    return [t for o in outs for t in o.token_ids], outs[0].num_cached_tokens


async def test_adapter_changes_output_and_never_shares_blocks(engine, prompt, adapter_dir, tmp_path):
    assert isinstance(engine, ServesLora)
    base, _ = await run(engine, "base-1", prompt)
    _, cached = await run(engine, "base-2", prompt)
    assert cached > 0  # the base prompt's blocks are cached

    manager = AdapterManager(engine.load_lora, engine.unload_lora, tmp_path / "cache")
    await asyncio.gather(*(manager.load("bananas", adapter_dir.as_uri()) for _ in range(4)))
    assert engine.lora_names == ["bananas"]

    engine.test_events.clear()
    tuned, cached = await run(engine, "lora-1", prompt, "bananas")
    assert tuned != base
    assert "Banana" in engine.tokenizer.decode(tuned)
    assert cached == 0  # the base model's blocks of the same prompt are not reused
    stored = [h for ev in engine.test_events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored and all(ev.lora_name == "bananas" for ev in engine.test_events if isinstance(ev, BlockStored))
    base_hashes = set(compute_block_hashes(prompt, engine.block_size))
    assert set(stored) == set(compute_block_hashes(prompt + tuned[:-1], engine.block_size, "bananas"))
    assert not set(stored) & base_hashes
    again, cached = await run(engine, "lora-2", prompt, "bananas")
    assert again == tuned and cached > 0  # the adapter reuses its own blocks

    # Base and adapter requests in one batch each keep their own output.
    both = await asyncio.gather(run(engine, "mix-base", prompt), run(engine, "mix-lora", prompt, "bananas"))
    assert [t for t, _ in both] == [base, tuned]

    # A second adapter (the same weights under another name): its own blocks, the same output; it stays
    # loaded when the first one goes.
    await manager.load("bananas2", str(adapter_dir))
    second, cached = await run(engine, "lora2-1", prompt, "bananas2")
    assert second == tuned and cached == 0
    assert await manager.unload("bananas")
    assert engine.lora_names == ["bananas2"]
    assert (await run(engine, "lora2-2", prompt, "bananas2"))[0] == tuned
    assert (await run(engine, "base-mid", prompt))[0] == base
    assert await manager.unload("bananas2")
    assert engine.lora_names == []
    after, _ = await run(engine, "base-3", prompt)
    assert after == base
    with pytest.raises(EngineError, match="not loaded"):
        await run(engine, "lora-3", prompt, "bananas")
