"""Prompt-lookup speculative decoding on the hf engine (real SmolLM2-135M-Instruct, CPU)."""

from __future__ import annotations

import pytest

from kvflow.schemas import BlockStored, ChatMessage, SamplingParams
from kvflow.workers.engines.base import EngineConfig, GenerateRequest
from kvflow.workers.engines.hf import HfEngine

pytestmark = pytest.mark.slow

ECHO = ("Repeat the following list exactly, one item per line:\n"
        + "\n".join(f"- item {i}: the {w} river" for i, w in enumerate(["amber", "silver", "quiet", "northern"] * 3)))
QUESTIONS = [ECHO, "What is the capital of France?", "Write the numbers from 1 to 30 separated by commas."]


async def run(eng: HfEngine, rid: str, user: str, max_tokens: int = 80) -> tuple[list[int], list[list[int]]]:
    prompt = eng.tokenizer.encode_chat([ChatMessage(role="user", content=user)])
    tokens, chunks = [], []
    async for out in eng.generate(GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                              temperature=0.0))):
        tokens += out.token_ids
        chunks.append(out.token_ids)
    return tokens, chunks


@pytest.fixture(scope="module")
async def engines():
    plain = HfEngine(EngineConfig())
    spec = HfEngine(EngineConfig(extra={"spec_ngram_tokens": 4}))
    events: dict[str, list] = {"plain": [], "spec": []}
    plain.kv_event_sink, spec.kv_event_sink = events["plain"].extend, events["spec"].extend
    await plain.start()
    await spec.start()
    yield plain, spec, events
    await spec.stop()
    await plain.stop()


async def test_greedy_output_is_the_same_with_prompt_lookup(engines):
    plain, spec, events = engines
    assert plain.spec_decode_metrics() is None
    for i, question in enumerate(QUESTIONS):
        want, _ = await run(plain, f"p{i}", question)
        got, chunks = await run(spec, f"s{i}", question)
        assert got == want, question
    m = spec.spec_decode_metrics()
    print("prompt lookup:", m.model_dump())
    assert m.draft_tokens > 0 and m.accepted_tokens > 0 and m.verify_steps > 0
    assert 0 < m.acceptance_rate <= 1 and m.mean_accepted_length > 1
    # several tokens arrive in one output when drafts were accepted
    echoed, chunks = await run(spec, "echo-again", ECHO)
    assert max(len(c) for c in chunks) > 1
    # only accepted tokens become cached blocks: the same blocks as plain decoding stored
    stored = {k: [h for e in evs if isinstance(e, BlockStored) for h in e.block_hashes] for k, evs in events.items()}
    assert set(stored["spec"]) == set(stored["plain"])
