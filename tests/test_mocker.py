"""The mocker: MockerCore scheduling and timing, and the live MockerEngine."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import time

import pytest

from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.schemas import BlockStored, FinishReason, SamplingParams
from kvflow.workers.engines.base import EngineConfig, EngineError, GenerateRequest
from kvflow.workers.engines.mocker import MockerEngine, StepClock
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore


def req(rid: str, prompt: list[int], max_tokens: int, lora: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), lora)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def run_all(core: MockerCore, max_steps: int = 100_000):
    """Step until idle; returns the list of StepResults."""
    results = []
    while core.has_work():
        results.append(core.step())
        assert len(results) < max_steps
    return results


# Dynamo's polynomial coefficients written out, so expectations do not reuse the module's code.
def prefill_ms(t: int) -> float:
    return 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142


def decode_ms(used: int, total: int) -> float:
    u = used / total
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


# ---- MockerCore -----------------------------------------------------------


def test_single_request_timing_and_outputs():
    core = MockerCore(MockerConfig())
    p = prompt(1000)
    core.add_request(req("a", p, 3))
    r1, r2, r3 = run_all(core)
    # Step 1 prefills 1000 tokens and samples the first token: 16 blocks in use.
    assert r1.duration_ms == pytest.approx(prefill_ms(1000) + decode_ms(16, 16384))
    assert r1.duration_ms == pytest.approx(32.1058589 + 5.792719593)  # by hand
    assert (r1.prefill_tokens, r1.decode_tokens) == (1000, 0)
    # Steps 2, 3 decode one token each (1001, 1002 tokens still fit 16 blocks).
    for r in (r2, r3):
        assert r.duration_ms == pytest.approx(decode_ms(16, 16384))
        assert (r.prefill_tokens, r.decode_tokens) == (0, 1)
    outs = [r.outputs["a"] for r in (r1, r2, r3)]
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.length]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    # The 15 full prompt blocks are stored at the end of the prefill step.
    assert r1.kv_events == [BlockStored(parent_block_hash=None, block_hashes=compute_block_hashes(p, 64)[:15])]
    assert not core.has_work()
    stats = core.stats()
    assert (stats.used_blocks, stats.active_requests, stats.prefill_tokens_total, stats.decode_tokens_total) == (0, 0, 1000, 2)


def test_chunked_prefill_across_steps_with_small_budget():
    core = MockerCore(MockerConfig(block_size=16, max_num_batched_tokens=256))
    core.add_request(req("a", prompt(600), 2))
    results = run_all(core)
    assert [r.prefill_tokens for r in results] == [256, 256, 88, 0]
    assert [list(r.outputs) for r in results] == [[], [], ["a"], ["a"]]
    # Chunk-only steps carry no decode time; the step finishing the prefill does.
    assert results[0].duration_ms == pytest.approx(prefill_ms(256))
    assert results[1].duration_ms == pytest.approx(prefill_ms(256))
    assert results[2].duration_ms == pytest.approx(prefill_ms(88) + decode_ms(38, 16384))  # 600 tokens = 38 blocks
    # Full blocks are published as each chunk completes them.
    stored = [sum(len(e.block_hashes) for e in r.kv_events) for r in results]
    assert stored == [16, 16, 5, 0]


def test_decoding_requests_share_the_token_budget():
    core = MockerCore(MockerConfig(block_size=16, max_num_batched_tokens=100))
    core.add_request(req("d", prompt(10, seed=1), 50))
    core.step()  # d prefilled, now decoding
    core.add_request(req("p", prompt(300, seed=2), 1))
    r = core.step()
    assert (r.decode_tokens, r.prefill_tokens) == (1, 99)
    assert core.stats().active_prefill_tokens == 300 - 99


def test_stats_count_the_prefill_of_the_step_in_flight():
    core = MockerCore(MockerConfig(block_size=16, max_num_batched_tokens=256))
    core.add_request(req("a", prompt(600), 2))
    first = core.step()
    # The step computed 256 tokens at once; until it ends they are still work ahead.
    assert core.stats().active_prefill_tokens == 600 - 256
    assert core.stats(first).active_prefill_tokens == 600
    last = run_all(core)[-1]
    assert core.stats(last).active_prefill_tokens == 0


def test_prefix_cache_hit_on_second_identical_request():
    core = MockerCore(MockerConfig())
    p = prompt(1000)
    core.add_request(req("a", p, 2))
    run_all(core)
    core.add_request(req("b", p, 2))
    r = core.step()
    # 15 full blocks (960 tokens) are reused; only 40 tokens are prefilled.
    assert r.prefill_tokens == 40
    assert r.outputs["b"].num_cached_tokens == 960
    assert r.duration_ms == pytest.approx(prefill_ms(40) + decode_ms(16, 16384))
    assert r.kv_events == []  # nothing new to store
    # A different LoRA adapter does not share the cache.
    core.add_request(req("c", p, 1, lora="ad"))
    r = core.step()
    assert r.prefill_tokens == 1000 and r.outputs["c"].num_cached_tokens == 0


def test_full_prompt_hit_still_computes_one_block():
    core = MockerCore(MockerConfig())
    p = prompt(1024)  # exactly 16 blocks
    core.add_request(req("a", p, 1))
    run_all(core)
    core.add_request(req("b", p, 1))
    r = core.step()
    assert r.outputs["b"].num_cached_tokens == 960 and r.prefill_tokens == 64


def test_concurrent_requests_share_committed_prefix():
    core = MockerCore(MockerConfig(block_size=16))
    p = prompt(320)
    core.add_request(req("a", p, 10))
    core.step()
    core.add_request(req("b", p + prompt(40, seed=5), 2))
    r = core.step()
    assert r.outputs["b"].num_cached_tokens == 320
    assert r.prefill_tokens == 40 and r.decode_tokens == 1
    # a holds 321 tokens (21 blocks), b 360 (23 blocks); the 20 shared blocks count once.
    assert core.pool.num_used_blocks == 21 + 23 - 20


def test_preemption_under_tiny_kv():
    cfg = MockerConfig(block_size=4, num_kv_blocks=10)
    core = MockerCore(cfg)
    core.add_request(req("a", prompt(8, seed=1), 20))
    core.add_request(req("b", prompt(8, seed=2), 20))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finish: dict[str, FinishReason] = {}
    preempt_step = None
    for step in range(1, 200):
        if not core.has_work():
            break
        before = core.num_preemptions
        r = core.step()
        for rid, out in r.outputs.items():
            tokens[rid] += out.token_ids
            if out.finish_reason:
                finish[rid] = out.finish_reason
        if core.num_preemptions > before and preempt_step is None:
            preempt_step = step
            # The newest request goes back to waiting; the older one keeps decoding.
            assert set(r.outputs) == {"a"}
            assert core.stats().waiting_requests == 1 and core.stats().active_requests == 1
        assert core.pool.num_used_blocks <= 10
    # 2 × ceil((8 + k - 1) / 4) > 10 first at step 14.
    assert preempt_step == 14
    assert finish == {"a": FinishReason.length, "b": FinishReason.length}
    assert len(tokens["a"]) == len(tokens["b"]) == 20
    # Preemption does not change what a request generates.
    roomy = MockerCore(MockerConfig(block_size=4, num_kv_blocks=100))
    roomy.add_request(req("b", prompt(8, seed=2), 20))
    assert [t for r in run_all(roomy) for t in r.outputs["b"].token_ids] == tokens["b"]


def test_request_larger_than_kv_is_rejected_and_bad_requests():
    core = MockerCore(MockerConfig(block_size=4, num_kv_blocks=10))
    with pytest.raises(EngineError):
        core.add_request(req("big", prompt(30), 20))  # 49 KV slots > 40
    core.add_request(req("fits", prompt(30), 11))  # 40 slots
    with pytest.raises(EngineError):
        core.add_request(req("fits", prompt(3), 1))  # duplicate id
    with pytest.raises(EngineError):
        core.add_request(req("empty", [], 1))
    with pytest.raises(EngineError):
        core.add_request(req("neg", [1, -2, 3, 4], 1))  # not a u32 token id
    assert len(run_all(core)) == 11


def test_outputs_are_deterministic_and_seeded():
    def tokens(seed: int, rid: str = "x") -> list[int]:
        core = MockerCore(MockerConfig(seed=seed, vocab_size=1000))
        core.add_request(req(rid, prompt(100), 40))
        return [t for r in run_all(core) for t in r.outputs[rid].token_ids]

    first = tokens(7)
    assert first == tokens(7)
    assert first != tokens(8)
    assert first != tokens(7, rid="y")
    assert all(0 <= t < 1000 for t in first) and len(set(first)) > 30


def test_whole_runs_are_reproducible():
    def run() -> list:
        core = MockerCore(MockerConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=128))
        shared = prompt(200, seed=9)
        for i in range(6):
            core.add_request(req(f"r{i}", shared[: 100 + 20 * i] + prompt(30, seed=i), 15 + i))
        return [(r.duration_ms, sorted((k, v.token_ids) for k, v in r.outputs.items()), r.kv_events) for r in run_all(core)]

    assert run() == run()


def test_speedup_ratio_divides_durations():
    def durations(speedup: float) -> list[float]:
        core = MockerCore(MockerConfig(speedup_ratio=speedup))
        core.add_request(req("a", prompt(3000), 5))
        return [r.duration_ms for r in run_all(core)]

    slow, fast = durations(1.0), durations(10.0)
    assert fast == pytest.approx([d / 10 for d in slow])


def test_max_num_seqs_limits_running():
    core = MockerCore(MockerConfig(max_num_seqs=2))
    for i in range(3):
        core.add_request(req(f"r{i}", prompt(50, seed=i), 3))
    r = core.step()
    assert set(r.outputs) == {"r0", "r1"}
    assert core.stats().waiting_requests == 1
    core.step()
    r = core.step()  # r0, r1 finish here; r2 gets a seat next step
    assert {k for k, v in r.outputs.items() if v.finish_reason} == {"r0", "r1"}
    r = core.step()
    assert set(r.outputs) == {"r2"}


def test_chunked_prefill_disabled_waits_for_room():
    core = MockerCore(MockerConfig(block_size=16, max_num_batched_tokens=100, enable_chunked_prefill=False))
    core.add_request(req("small", prompt(10), 5))
    core.add_request(req("long", prompt(150, seed=3), 1))
    r = core.step()
    assert set(r.outputs) == {"small"}  # long does not fit beside it
    assert core.stats().waiting_requests == 1
    results = run_all(core)
    long_steps = [r for r in results if "long" in r.outputs]
    assert len(long_steps) == 1 and long_steps[0].prefill_tokens == 150  # ran alone, over budget


def test_abort_releases_blocks():
    core = MockerCore(MockerConfig(block_size=16))
    core.add_request(req("a", prompt(100), 100))
    core.add_request(req("b", prompt(100, seed=1), 100))
    core.add_request(req("c", prompt(100, seed=2), 100))
    core.step()
    core.abort("a")
    core.abort("nope")
    assert core.stats().active_requests == 2
    core.abort("b")
    core.abort("c")
    assert not core.has_work() and core.pool.num_used_blocks == 0
    assert core.step().duration_ms == 0.0


def test_dump_matches_stored_events():
    core = MockerCore(MockerConfig(block_size=16))
    stored: set[int] = set()
    for i in range(3):
        core.add_request(req(f"r{i}", prompt(100, seed=i), 40))
    for r in run_all(core):
        for e in r.kv_events:
            assert isinstance(e, BlockStored)  # nothing evicted with this much room
            stored.update(e.block_hashes)
    dumped = {h for e in core.dump_kv_events() for h in e.block_hashes}
    # Prompt blocks and blocks filled by generated tokens: 3 × (139 // 16).
    assert dumped == stored and len(dumped) == 3 * 8


def test_perf_256_running(capsys):
    core = MockerCore(MockerConfig())
    for i in range(256):
        core.add_request(req(f"r{i}", prompt(2000, seed=i), 10_000))
    while core.stats().waiting_requests or core.stats().active_prefill_tokens:
        core.step()
    steps = 300
    start = time.perf_counter()
    for _ in range(steps):
        r = core.step()
    elapsed = time.perf_counter() - start
    assert len(r.outputs) == 256 and r.decode_tokens == 256
    with capsys.disabled():
        print(f"\nmocker core: {steps / elapsed:.0f} steps/s with 256 running ({elapsed / steps * 1e3:.3f} ms/step)")


# ---- MockerEngine (live) ----------------------------------------------------


class RecordingSleep:
    """Records requested sleeps and yields to the loop instead of waiting."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        await asyncio.sleep(0)


async def test_live_engine_two_concurrent_requests():
    sleep = RecordingSleep()
    engine = MockerEngine(MockerConfig(block_size=16), sleep=sleep)
    events: list = []
    engine.kv_event_sink = events.extend
    await engine.start()
    order: list[str] = []

    async def consume(rid: str, n_prompt: int, n_out: int):
        outs = []
        async for out in engine.generate(req(rid, prompt(n_prompt, seed=len(rid)), n_out)):
            order.append(rid)
            outs.append(out)
        return outs

    try:
        a, b = await asyncio.wait_for(asyncio.gather(consume("a", 200, 12), consume("bb", 100, 8)), 10)
    finally:
        await engine.stop()
    assert [len(o.token_ids) for o in a] == [1] * 12 and a[-1].finish_reason == FinishReason.length
    assert [len(o.token_ids) for o in b] == [1] * 8 and b[-1].finish_reason == FinishReason.length
    # Both progress together: both start in the first step, and a kept generating while bb ran.
    assert set(order[:2]) == {"a", "bb"}
    last_bb = len(order) - 1 - order[::-1].index("bb")
    assert order[:last_bb].count("a") >= 7 and order[-1] == "a"
    # Full blocks of computed tokens (prompt + all outputs but the last): 211 // 16 + 107 // 16.
    assert sum(len(e.block_hashes) for e in events) == 13 + 6
    assert all(s > 0 for s in sleep.seconds) and len(sleep.seconds) == 12
    assert sleep.seconds[0] == pytest.approx((prefill_ms(300) + decode_ms(13 + 7, 16384)) / 1000)
    assert engine.kv_stats().used_blocks == 0


async def test_live_engine_reports_the_prefill_it_is_sleeping_through():
    seen: list[int] = []
    engine: MockerEngine

    async def sleep(seconds: float) -> None:
        seen.append(engine.kv_stats().active_prefill_tokens)
        await asyncio.sleep(0)

    engine = MockerEngine(MockerConfig(block_size=16, max_num_batched_tokens=256), sleep=sleep)
    await engine.start()
    try:
        outs = [o async for o in engine.generate(req("a", prompt(600), 2))]
    finally:
        await engine.stop()
    assert len(outs) == 2
    # Chunks of 256, 256, 88 prompt tokens, then one decode step.
    assert seen == [600, 344, 88, 0]
    assert engine.kv_stats().active_prefill_tokens == 0


async def test_live_engine_real_clock_with_speedup():
    engine = MockerEngine(MockerConfig(speedup_ratio=10.0))
    await engine.start()
    start = time.monotonic()
    try:
        outs = [o async for o in engine.generate(req("a", prompt(2000), 5))]
    finally:
        await engine.stop()
    elapsed = time.monotonic() - start
    expected_s = (prefill_ms(2000) + 5 * decode_ms(32, 16384)) / 10 / 1000  # about 9 ms
    assert len(outs) == 5 and outs[-1].finish_reason == FinishReason.length
    assert elapsed >= expected_s * 0.9


async def test_live_engine_abort_and_stop():
    engine = MockerEngine(MockerConfig(block_size=16), sleep=RecordingSleep())
    await engine.start()
    got = []
    async for out in engine.generate(req("a", prompt(50), 1000)):
        got.append(out)
        if len(got) == 3:
            await engine.abort("a")
    assert got[-1].finish_reason == FinishReason.abort and len(got) == 4
    assert engine.kv_stats().used_blocks == 0 and not engine.core.has_work()

    gen = engine.generate(req("b", prompt(50), 1000))
    first = await gen.__anext__()
    assert first.finish_reason is None
    await engine.stop()
    rest = [o async for o in gen]
    assert rest[-1].finish_reason == FinishReason.abort
    with pytest.raises(EngineError):
        await engine.generate(req("c", prompt(5), 1)).__anext__()  # stopped


async def test_live_engine_leaving_early_aborts():
    engine = MockerEngine(MockerConfig(block_size=16), sleep=RecordingSleep())
    await engine.start()
    try:
        gen = engine.generate(req("a", prompt(50), 1000))
        await gen.__anext__()
        await gen.aclose()
        assert not engine.core.has_work()
    finally:
        await engine.stop()


def test_engine_identity_and_config():
    engine = MockerEngine.from_engine_config(
        EngineConfig(model="m", block_size=32, num_kv_blocks=100, max_batch_size=4, extra={"speedup_ratio": 5.0})
    )
    assert engine.name == "mocker" and engine.model_name == "m" and engine.block_size == 32
    assert (engine.config.num_kv_blocks, engine.config.max_num_seqs, engine.config.speedup_ratio) == (100, 4, 5.0)
    assert engine.kv_stats().total_blocks == 100
    with pytest.raises(ValueError):
        MockerEngine.from_engine_config(EngineConfig(extra={"nope": 1}))
    with pytest.raises(ValueError):
        MockerConfig(speedup_ratio=0)
    has_tokenizer_module = importlib.util.find_spec("kvflow.models.tokenizer") is not None
    assert (engine.tokenizer is not None) == has_tokenizer_module
    if engine.tokenizer is not None:
        assert engine.config.vocab_size == engine.tokenizer.vocab_size  # every output id decodes
        explicit = MockerEngine.from_engine_config(EngineConfig(extra={"vocab_size": 1000}))
        assert explicit.config.vocab_size == 1000


def test_step_clock_paces_back_to_back_steps_from_the_previous_end():
    clock = StepClock(max_catch_up_s=0.02)
    assert clock.next_end(10.0, 0.008) == pytest.approx(10.008)  # first step: starts when computed
    # Computed 3 ms late (the core's own time, a busy loop): still ends 8 ms after the last end.
    assert clock.next_end(10.011, 0.008) == pytest.approx(10.016)
    # Computed exactly on time.
    assert clock.next_end(10.016, 0.010) == pytest.approx(10.026)
    # A stall longer than the catch-up bound is not made up.
    assert clock.next_end(10.5, 0.008) == pytest.approx(10.508)
    # After idling, the next step starts when computed, however soon.
    clock.idle()
    assert clock.next_end(10.509, 0.008) == pytest.approx(10.517)


async def test_live_engine_steps_keep_the_modelled_pace_on_a_late_loop():
    """The consumer blocks the loop 12 ms after every output, longer than a ~6 ms
    decode step, so every step is computed late; each still ends one modelled
    duration after the previous end instead of one duration after it was computed."""
    engine = MockerEngine(MockerConfig(block_size=16))
    engine._clock = StepClock(max_catch_up_s=3600.0)  # make up any lateness, however loaded the machine
    steps: list[tuple[float, float, float]] = []
    next_end = engine._clock.next_end

    def recording(computed_s: float, duration_s: float) -> float:
        steps.append((computed_s, duration_s, next_end(computed_s, duration_s)))
        return steps[-1][2]

    engine._clock.next_end = recording
    await engine.start()
    try:
        async for _ in engine.generate(req("a", prompt(64), 20)):
            time.sleep(0.012)  # the worker's own work on the same loop
    finally:
        await engine.stop()
    assert len(steps) == 20
    assert steps[0][2] == pytest.approx(steps[0][0] + steps[0][1])
    late = 0
    for (computed, duration, end), (_, _, prev_end) in zip(steps[1:], steps):
        assert end == pytest.approx(prev_end + duration)
        late += computed - prev_end > 0.001
    assert late >= 10, f"only {late} of 19 steps were computed late; the loop was not blocked as meant"
