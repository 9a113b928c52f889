"""The ``hf`` engine with KV tiers on SmolLM2-135M-Instruct (CPU): real KV tensors leave G1 for host
memory and disk and come back bit-identical; a damaged disk block is recomputed."""

from __future__ import annotations

import pytest
import torch

from kvflow.schemas import BlockStored, KvTier, SamplingParams
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.workers.engines.base import EngineConfig, GenerateRequest
from kvflow.workers.engines.hf import HfEngine

pytestmark = pytest.mark.slow

BS = 16
PROMPT_P = " ".join(f"Fact {i}: the {w} river flows past {i * 7} old mills before it reaches the sea."
                    for i, w in enumerate(["amber", "silver", "quiet", "northern"] * 3))
PROMPT_Q = " ".join(f"Note {i}: a {w} lantern hangs above door number {i * 3} on the harbour street."
                    for i, w in enumerate(["red", "green", "blue", "yellow"] * 3))
G1_BLOCKS = 4


@pytest.fixture(scope="module")
async def engine(tmp_path_factory):
    """G1 of 4 blocks, G2 of 2 blocks, G3 of 1 GiB that takes every block leaving G2."""
    disk_dir = tmp_path_factory.mktemp("g3")
    eng = HfEngine(EngineConfig(block_size=BS, num_kv_blocks=G1_BLOCKS, extra={
        "kv_host_gb": 2 * 737_280 / 2**30, "kv_disk_gb": 1.0, "kv_disk_dir": str(disk_dir),
        "kv_disk_min_frequency": 0.0}))
    events: list = []
    eng.kv_event_sink = events.extend
    await eng.start()
    eng.test_events = events
    eng.test_disk_dir = disk_dir
    yield eng
    await eng.stop()


async def run(eng: HfEngine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy, 8 tokens; returns (tokens, num_cached_tokens)."""
    tokens, cached = [], None
    async for out in eng.generate(GenerateRequest(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True))):
        tokens += out.token_ids
        if cached is None:
            cached = out.num_cached_tokens
    return tokens, cached


def held_kv(eng: HfEngine, hashes: list[int]) -> dict[int, torch.Tensor]:
    """Every block of ``hashes`` held in any tier now, as a copy (G1, then G2, then G3 read back)."""
    out = {}
    for h in hashes:
        block = eng._cache.get(h)
        if block is None and eng._tiers.tier_of(h) is KvTier.host:
            block = eng._tiers._host[h].payload
        if block is None and eng._tiers.tier_of(h) is KvTier.disk:
            block = eng._tiers.disk.read(h)
        if block is not None:
            out[h] = block.clone()
    return out


async def test_evict_offload_onboard_is_bit_identical(engine):
    tok = engine.tokenizer
    p, q = tok.encode_prompt(PROMPT_P), tok.encode_prompt(PROMPT_Q)
    hashes = compute_block_hashes(p, BS)
    usable = (len(p) - 1) // BS
    assert usable > G1_BLOCKS + 4  # the prompt outgrows G1 and G2

    cold, cached0 = await run(engine, "p-cold", p)
    assert cached0 == 0
    computed = held_kv(engine, hashes)
    assert set(computed) == set(hashes)  # every block is somewhere: G1, G2 or G3
    stats = engine.tier_stats
    assert stats.offloaded_blocks > 0 and stats.demoted_blocks > 0
    await run(engine, "q", q)  # pushes p's last G1 blocks down too

    warm, cached = await run(engine, "p-warm", p)
    assert warm == cold  # identical greedy output
    assert cached == usable * BS  # the whole usable prefix came from the tiers, none recomputed
    assert stats.onboarded_disk_blocks > 0 and stats.onboarded_host_blocks + stats.onboarded_disk_blocks >= usable - \
        G1_BLOCKS
    assert stats.onboard_ms > 0
    # The KV loaded back is the KV computed, bit for bit.
    for h, block in held_kv(engine, hashes).items():
        assert torch.equal(block, computed[h]), h
    # Capacities held: G2's byte budget, and G3's files.
    tiers = engine._tiers
    assert tiers.host_used_bytes <= tiers.config.host_bytes
    on_disk = sum(f.stat().st_size for f in engine.test_disk_dir.iterdir())
    assert on_disk == tiers.disk_used_bytes <= tiers.config.disk_bytes
    assert not list(engine.test_disk_dir.glob("*.tmp"))
    # Host and disk residency were published as KV events.
    tiers_seen = {e.tier for e in engine.test_events if isinstance(e, BlockStored)}
    assert {KvTier.device, KvTier.host, KvTier.disk} <= tiers_seen


async def test_corrupt_disk_block_is_recomputed(engine):
    tok = engine.tokenizer
    p, q = tok.encode_prompt(PROMPT_P), tok.encode_prompt(PROMPT_Q)
    hashes = compute_block_hashes(p, BS)
    usable = (len(p) - 1) // BS
    reference, _ = await run(engine, "p-ref", p)
    await run(engine, "q2", q)
    tiers = engine._tiers
    on_disk = [i for i, h in enumerate(hashes[:usable]) if tiers.lookup([h]) == [KvTier.disk]
               and engine._cache.get(h) is None]
    assert on_disk, "some of p's blocks should sit only on disk"
    bad = on_disk[0]
    path = tiers.disk.path(hashes[bad])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(raw)
    before = tiers.stats.disk_corrupt_blocks

    tokens, cached = await run(engine, "p-after-corruption", p)
    assert tokens == reference  # same greedy output: the damaged block was recomputed, not served
    assert tiers.stats.disk_corrupt_blocks == before + 1
    assert cached < usable * BS  # the prefix stopped at (or before) the damaged block


async def test_stop_deletes_the_disk_files(tmp_path):
    eng = HfEngine(EngineConfig(block_size=BS, num_kv_blocks=2, extra={
        "kv_disk_gb": 0.1, "kv_disk_dir": str(tmp_path / "g3"), "kv_disk_min_frequency": 0.0}))
    await eng.start()
    try:
        await run(eng, "p", eng.tokenizer.encode_prompt(PROMPT_P))
        assert list((tmp_path / "g3").glob("*.kv"))  # no host tier: evicted blocks went straight to disk
    finally:
        await eng.stop()
    assert list((tmp_path / "g3").iterdir()) == []
