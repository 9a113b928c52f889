"""The mocker can tokenize like a real model, so prompt lengths match it."""

import pytest

from kvflow.models.tokenizer import load_tokenizer
from kvflow.schemas import ChatMessage, SamplingParams
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.main import build_engine

pytestmark = pytest.mark.slow


async def test_mocker_with_smollm2_tokenizer():
    engine, name, spec = build_engine("mocker", "mock", speedup_ratio=1000.0, tokenizer="SmolLM2-135M-Instruct")
    assert spec != "bytes" and name == "mock"
    hf = load_tokenizer(spec)
    messages = [ChatMessage(role="user", content="What is the capital of France?")]
    ids = engine.tokenizer.encode_chat(messages)
    assert ids == hf.encode_chat(messages)
    await engine.start()
    try:
        outs = [o async for o in engine.generate(GenerateRequest("r", ids, SamplingParams(max_tokens=6)))]
    finally:
        await engine.stop()
    out_ids = [t for o in outs for t in o.token_ids]
    assert len(out_ids) == 6 and all(0 <= t < hf.vocab_size for t in out_ids)
    assert hf.decode(out_ids).strip()
