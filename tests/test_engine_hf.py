"""The ``hf`` engine on the real SmolLM2-135M-Instruct model (CPU)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.schemas import BlockRemoved, BlockStored, ChatMessage, FinishReason, SamplingParams
from kvflow.workers.engines.base import EngineConfig, EngineError, EngineOutput, GenerateRequest
from kvflow.workers.engines.hf import HfEngine

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0)
FRANCE = "What is the capital of France?"
# ~30 sentences: a prompt of several hundred tokens, i.e. many 16-token blocks.
LONG_CONTEXT = " ".join(
    f"Fact {i}: the {w} river flows past {i * 7} old mills before it reaches the sea."
    for i, w in enumerate(["amber", "silver", "quiet", "northern", "winding", "broad"] * 5)
)


@pytest.fixture(scope="module")
async def engine():
    """The default engine; a 64-block prefix cache so eviction is reachable in a test."""
    eng = HfEngine(EngineConfig(num_kv_blocks=64))
    events: list = []
    eng.kv_event_sink = events.extend
    await eng.start()
    eng.test_events = events
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
async def plain_engine():
    """Same model without a prefix cache: isolates batching from cache reuse."""
    eng = HfEngine(EngineConfig(extra={"enable_prefix_caching": False}))
    await eng.start()
    yield eng
    await eng.stop()


def chat(eng: HfEngine, user: str, system: str | None = None) -> list[int]:
    messages = [ChatMessage(role="system", content=system)] if system else []
    return eng.tokenizer.encode_chat(messages + [ChatMessage(role="user", content=user)])


async def collect(eng: HfEngine, request_id: str, prompt: list[int], log: list | None = None, **sampling):
    """Run one request; return (token ids, finish reason, outputs)."""
    outputs: list[EngineOutput] = []
    async for out in eng.generate(GenerateRequest(request_id, prompt, SamplingParams(**sampling))):
        outputs.append(out)
        if log is not None:
            log.append((request_id, time.perf_counter()))
    tokens = [t for o in outputs for t in o.token_ids]
    return tokens, outputs[-1].finish_reason, outputs


async def test_greedy_answer_mentions_paris(engine):
    tokens, finish, outputs = await collect(engine, "france", chat(engine, FRANCE), max_tokens=20, **GREEDY)
    text = engine.tokenizer.decode(tokens)
    assert "Paris" in text
    assert finish in (FinishReason.stop, FinishReason.length)
    assert len(tokens) <= 20
    assert all(o.finish_reason is None for o in outputs[:-1])
    if finish is FinishReason.stop:
        assert tokens[-1] in engine.tokenizer.eos_token_ids  # EOS is the last token sent


async def test_max_tokens_finishes_with_length(engine):
    tokens, finish, outputs = await collect(
        engine, "len5", chat(engine, "Count from one to fifty."), max_tokens=5, ignore_eos=True, **GREEDY
    )
    assert len(tokens) == 5
    assert finish is FinishReason.length
    assert [len(o.token_ids) for o in outputs] == [1] * 5  # streamed one token per step


async def test_two_concurrent_requests_progress_together(engine):
    before = engine.decode_steps_by_batch_size.copy()
    log: list = []
    a, b = await asyncio.gather(
        collect(engine, "conc-a", chat(engine, "Describe a forest."), log, max_tokens=16, ignore_eos=True, **GREEDY),
        collect(engine, "conc-b", chat(engine, "Describe a desert."), log, max_tokens=16, ignore_eos=True, **GREEDY),
    )
    assert len(a[0]) == len(b[0]) == 16
    assert a[1] is b[1] is FinishReason.length
    order = [rid for rid, _ in log]
    # Interleaved, not one after the other: each finished after the other had started.
    assert order.index("conc-b") < len(order) - 1 - order[::-1].index("conc-a")
    assert order.index("conc-a") < len(order) - 1 - order[::-1].index("conc-b")
    switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
    assert switches >= 10
    batched_steps = sum(n for size, n in (engine.decode_steps_by_batch_size - before).items() if size >= 2)
    assert batched_steps >= 10  # one forward pass served both requests


async def test_batching_does_not_change_greedy_output(plain_engine):
    eng = plain_engine
    prompts = {
        "short": chat(eng, "Name a color."),
        "long": chat(eng, "Explain in detail how a steam engine works, step by step, for a curious child."),
        "mid": chat(eng, "Write one sentence about the moon."),
    }
    alone = {}
    for k, p in prompts.items():
        alone[k] = (await collect(eng, f"alone-{k}", p, max_tokens=24, ignore_eos=True, **GREEDY))[0]

    started = {k: asyncio.Event() for k in prompts}

    async def join_after(k: str, previous: str | None):
        # Join mid-generation, once the previous request has 4 tokens: different
        # prompt lengths, padding and batch sizes along the way.
        if previous is not None:
            await started[previous].wait()
        tokens: list[int] = []
        request = GenerateRequest(f"batched-{k}", prompts[k], SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
        async for out in eng.generate(request):
            tokens += out.token_ids
            if len(tokens) >= 4:
                started[k].set()
        return k, tokens

    before = eng.decode_steps_by_batch_size.copy()
    joins = (join_after("short", None), join_after("long", "short"), join_after("mid", "long"))
    batched = dict(await asyncio.gather(*joins))
    assert sum(n for size, n in (eng.decode_steps_by_batch_size - before).items() if size >= 3) > 0
    for k in prompts:
        decode = eng.tokenizer.decode
        assert batched[k] == alone[k], f"{k}: {decode(alone[k])!r} != {decode(batched[k])!r}"


async def test_prefix_cache_hit_reuses_kv_and_keeps_output(engine):
    prompt = chat(engine, "Which river passes 21 old mills? " + LONG_CONTEXT, system="You answer from the facts.")
    assert len(prompt) > 300
    first, _, first_outs = await collect(engine, "prefix-1", prompt, max_tokens=12, **GREEDY)
    second, _, second_outs = await collect(engine, "prefix-2", prompt, max_tokens=12, **GREEDY)
    assert first_outs[0].num_cached_tokens == 0
    expected_cached = (len(prompt) - 1) // engine.block_size * engine.block_size
    assert second_outs[0].num_cached_tokens == expected_cached
    assert all(o.num_cached_tokens == 0 for o in second_outs[1:])
    assert second == first
    # The stored blocks were announced as KV events with the router's hashes, chained by parent.
    hashes = compute_block_hashes(prompt, engine.block_size)
    stored = [e for e in engine.test_events if isinstance(e, BlockStored)]
    announced = [h for e in stored for h in e.block_hashes]
    assert set(hashes) <= set(announced)
    for event in stored:
        if event.block_hashes[0] == hashes[0]:
            assert event.parent_block_hash is None
        elif event.block_hashes[0] in hashes:
            assert event.parent_block_hash == hashes[hashes.index(event.block_hashes[0]) - 1]
    assert engine.kv_stats().used_blocks >= len(hashes)


async def test_prefix_cache_evicts_least_recent_blocks(engine):
    capacity = engine.kv_stats().total_blocks
    assert capacity == 64
    seen = len(engine.test_events)
    for i in range(3):  # three distinct ~400-token prompts: more blocks than the cache holds
        prompt = chat(engine, f"Variant {i}. " + LONG_CONTEXT, system=f"Archive {i}.")
        await collect(engine, f"evict-{i}", prompt, max_tokens=1, **GREEDY)
    removed = [h for e in engine.test_events[seen:] if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "no BlockRemoved event although the cache overflowed"
    stats = engine.kv_stats()
    assert stats.used_blocks <= capacity and stats.active_requests == 0
    # The newest prompt's blocks survive; its prefix hits the cache.
    last = chat(engine, "Variant 2. " + LONG_CONTEXT, system="Archive 2.")
    _, _, outs = await collect(engine, "evict-check", last, max_tokens=1, **GREEDY)
    assert outs[0].num_cached_tokens > 0
    assert not set(compute_block_hashes(last, engine.block_size)[:4]) & set(removed)


async def test_stop_strings_cut_before_the_stop(engine):
    prompt = chat(engine, FRANCE)
    full, _, _ = await collect(engine, "stop-ref", prompt, max_tokens=20, **GREEDY)
    full_text = engine.tokenizer.decode(full)
    words = full_text.split(" ")
    assert len(words) >= 4, full_text
    for stop in (" " + words[2], " " + " ".join(words[1:3])):  # one word, and words spanning tokens
        tokens, finish, outputs = await collect(engine, f"stop-{stop}", prompt, max_tokens=20, stop=[stop], **GREEDY)
        assert finish is FinishReason.stop
        assert engine.tokenizer.decode(tokens) == full_text[: full_text.index(stop)]
        assert tokens == full[: len(tokens)]
    # A stop string that never appears changes nothing.
    tokens, finish, _ = await collect(engine, "stop-none", prompt, max_tokens=20, stop=["zebra"], **GREEDY)
    assert tokens == full


async def test_abort_mid_generation(engine):
    long_run = SamplingParams(max_tokens=400, ignore_eos=True)
    request = GenerateRequest("abort-me", chat(engine, "Tell me a long story."), long_run)
    outputs = []
    async for out in engine.generate(request):
        outputs.append(out)
        if len(outputs) == 3:
            await engine.abort("abort-me")
    assert outputs[-1].finish_reason is FinishReason.abort
    assert sum(len(o.token_ids) for o in outputs) < 20
    assert engine.kv_stats().active_requests == 0
    # Leaving the iteration early aborts too, and the engine keeps serving.
    gen = engine.generate(GenerateRequest("left-early", request.prompt_token_ids, long_run))
    await gen.__anext__()
    await gen.aclose()
    tokens, finish, _ = await collect(
        engine, "after-abort", chat(engine, FRANCE), max_tokens=3, ignore_eos=True, **GREEDY
    )
    assert len(tokens) == 3 and finish is FinishReason.length
    assert engine.kv_stats().active_requests == 0


async def test_seeded_sampling_is_reproducible(engine):
    prompt = chat(engine, "Invent a name for a cat.")
    sampled = dict(max_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True)
    runs = [
        (await collect(engine, f"seed-{i}", prompt, seed=seed, **sampled))[0] for i, seed in enumerate((7, 7, 8, 9))
    ]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs}) >= 2  # other seeds draw other tokens


async def test_bad_requests_raise_engine_error(engine):
    with pytest.raises(EngineError, match="empty prompt"):
        await collect(engine, "empty", [])
    with pytest.raises(EngineError, match="token id"):
        await collect(engine, "oov", [1, 10**6])
    assert engine.kv_stats().active_requests == 0
