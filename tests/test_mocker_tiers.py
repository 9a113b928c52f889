"""The mocker with KV tiers: evicted prompts are offloaded to G2/G3 and onboarded, at the modelled cost."""

from __future__ import annotations

import random

import pytest

from kvflow.schemas import BlockStored, KvTier, SamplingParams
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore, kv_onboard_time_ms

BS = 16
BLOCK_BYTES = BS * 131072


def req(rid: str, prompt: list[int], max_tokens: int = 2) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def serve(core: MockerCore, request: GenerateRequest, now_ms: float = 0.0):
    """Run one request alone to completion; returns (first output, results)."""
    core.add_request(request)
    results = []
    while core.has_work():
        results.append(core.step(now_ms=now_ms))
    first = next(o for r in results for rid, o in r.outputs.items() if rid == request.request_id)
    return first, results


def small(**kw) -> MockerConfig:
    return MockerConfig(block_size=BS, num_kv_blocks=8, max_num_batched_tokens=4096, **kw)


def test_onboard_from_host_instead_of_recompute():
    core = MockerCore(small(kv_host_bytes=64 * BLOCK_BYTES))
    a = prompt(6 * BS + 3, seed=1)
    serve(core, req("a1", a))
    serve(core, req("b", prompt(7 * BS + 3, seed=2)))  # evicts a's blocks from the 8-block pool
    assert core.pool.lookup(core_hashes(a)) == 0
    first, results = serve(core, req("a2", a))
    assert first.num_cached_tokens == 6 * BS  # all of a's full blocks, from G2
    assert results[0].prefill_tokens == 3
    assert results[0].onboard_ms == pytest.approx(kv_onboard_time_ms(core.config, 6, 0))
    assert core.tiers.stats.onboarded_host_blocks == 6
    assert core.cached_tokens_by_tier == {"device": 0, "host": 6 * BS, "disk": 0}
    host_stored = [e for r in results for e in r.kv_events if isinstance(e, BlockStored) and e.tier is KvTier.host]
    assert host_stored  # b's blocks left G1 for G2 when a's came back


def core_hashes(tokens: list[int]) -> list[int]:
    from kvflow.schemas.block_hash import compute_block_hashes

    return compute_block_hashes(tokens, BS)


def test_without_tiers_the_prompt_is_recomputed():
    core = MockerCore(small())
    a = prompt(6 * BS + 3, seed=1)
    serve(core, req("a1", a))
    serve(core, req("b", prompt(7 * BS + 3, seed=2)))
    first, results = serve(core, req("a2", a))
    assert first.num_cached_tokens == 0 and results[0].prefill_tokens == 6 * BS + 3


def test_disk_tier_keeps_reused_blocks_only():
    cfg = small(kv_host_bytes=2 * BLOCK_BYTES, kv_disk_bytes=64 * BLOCK_BYTES)
    core = MockerCore(cfg)
    a = prompt(6 * BS + 3, seed=1)
    for i in range(3):  # computed once, reused twice from G1: frequency 4
        serve(core, req(f"a{i}", a), now_ms=i)
    serve(core, req("b", prompt(7 * BS + 3, seed=2)), now_ms=10)  # a leaves G1; G2 holds 2 blocks
    serve(core, req("c", prompt(7 * BS + 3, seed=3)), now_ms=20)  # b's blocks (used once) pass G2, not G3
    held_disk = core.tiers.held(KvTier.disk)
    assert set(core_hashes(a)) <= held_disk
    assert not held_disk & set(core_hashes(prompt(7 * BS + 3, seed=2)))
    first, results = serve(core, req("a9", a), now_ms=30)
    assert first.num_cached_tokens == 6 * BS
    assert core.tiers.stats.onboarded_disk_blocks >= 1
    assert core.tiers.host_used_bytes <= cfg.kv_host_bytes and core.tiers.disk_used_bytes <= cfg.kv_disk_bytes


def test_recomputed_prefill_tokens_counted_across_workers():
    seen: set[int] = set()
    w1, w2 = MockerCore(small()), MockerCore(small())
    w1.computed_blocks = w2.computed_blocks = seen
    a = prompt(6 * BS + 3, seed=1)
    serve(w1, req("a1", a))
    assert w1.recomputed_prefill_tokens == 0
    serve(w2, req("a2", a))  # the other worker computes the same blocks again
    assert w2.recomputed_prefill_tokens == 6 * BS
    serve(w1, req("a3", a))  # a cache hit on w1: nothing recomputed
    assert w1.recomputed_prefill_tokens == 0


def test_tier_metrics_for_the_worker_record():
    from kvflow.schemas import KvTierMetrics, WorkerMetrics, decode, encode
    from kvflow.workers.engines.mocker import MockerEngine

    engine = MockerEngine(small(kv_host_bytes=64 * BLOCK_BYTES))
    assert MockerEngine(small()).kv_tier_metrics() is None
    core = engine.core
    a = prompt(6 * BS + 3, seed=1)
    serve(core, req("a1", a))
    serve(core, req("b", prompt(7 * BS + 3, seed=2)))
    serve(core, req("a2", a))
    m = engine.kv_tier_metrics()
    assert m.onboarded_host_blocks == 6 and m.onboarded_host_bytes == 6 * BLOCK_BYTES
    assert m.offloaded_blocks >= 6 and m.host_used_bytes == m.offloaded_bytes  # nothing left G2 yet
    assert m.host_hit_rate == pytest.approx(6 / 19) and m.device_hit_rate == 0.0  # 6 + 7 + 6 blocks looked up
    assert m.onboard_ms == pytest.approx(kv_onboard_time_ms(core.config, 6, 0))
    record = WorkerMetrics(ts_ms=1, worker_id="w", role="aggregated", active_requests=0, waiting_requests=0,
                           kv_used_blocks=0, kv_total_blocks=8, kv_tiers=m)
    assert decode(WorkerMetrics, encode(record)).kv_tiers == m
    old = WorkerMetrics(ts_ms=1, worker_id="w", role="aggregated", active_requests=0, waiting_requests=0,
                        kv_used_blocks=0, kv_total_blocks=8)
    assert decode(WorkerMetrics, encode(old)).kv_tiers is None and isinstance(m, KvTierMetrics)


def test_router_index_follows_the_tiers_from_kv_events():
    from kvflow.router.index import KvIndex

    cfg = small(kv_host_bytes=3 * BLOCK_BYTES, kv_disk_bytes=64 * BLOCK_BYTES)
    core = MockerCore(cfg)
    index = KvIndex(BS)
    rng = random.Random(3)
    prompts = [prompt(rng.randrange(2, 7) * BS + 3, seed=rng.randrange(4)) for _ in range(40)]
    for i, p in enumerate(prompts):
        core.add_request(req(f"r{i}", p))
        while core.has_work():
            index.on_kv_events("w", core.step(now_ms=i * 1000.0).kv_events)
    assert index.held("w", KvTier.host) == core.tiers.held(KvTier.host)
    assert index.held("w", KvTier.disk) == core.tiers.held(KvTier.disk)
    assert index.num_blocks("w", KvTier.device) == core.pool.num_cached_blocks
    assert core.tiers.num_blocks(KvTier.disk) > 0  # prompts repeat, so some blocks were reused enough for G3
    # The index credits each prompt block to the fastest tier holding it.
    for p in prompts[:8]:
        expected = {"device": 0, "host": 0, "disk": 0}
        for h in core_hashes(p):
            tier = "device" if core.pool.lookup([h]) else (core.tiers.tier_of(h) or None)
            if tier is None:
                break
            expected[KvTier(tier).value] += 1
        scores = index.find_matches(core_hashes(p))
        got = {t: getattr(scores, t).get("w", 0) for t in ("device", "host", "disk")}
        assert got == expected


async def test_clear_kv_cache_drops_the_lower_tiers_too():
    from kvflow.schemas import AllBlocksCleared
    from kvflow.workers.engines.mocker import MockerEngine

    engine = MockerEngine(small(kv_host_bytes=64 * BLOCK_BYTES))
    events: list = []
    engine.kv_event_sink = events.extend
    serve(engine.core, req("a", prompt(6 * BS + 3, seed=1)))
    serve(engine.core, req("b", prompt(7 * BS + 3, seed=2)))
    assert engine.core.tiers.num_blocks(KvTier.host) > 0
    ok, _ = await engine.clear_kv_cache()
    assert ok and engine.core.tiers.num_blocks(KvTier.host) == 0 and engine.core.tiers.host_used_bytes == 0
    assert events == [AllBlocksCleared()]
