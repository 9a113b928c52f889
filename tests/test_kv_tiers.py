"""The G2/G3 tiered KV store: offload, reuse-filtered demotion, onboarding, capacities, checksums."""

from __future__ import annotations

import random

import pytest

from kvflow.schemas import BlockRemoved, BlockStored, KvTier
from kvflow.workers.kv.disk import FileDisk, MemoryDisk
from kvflow.workers.kv.tiers import OffloadedBlock, TierConfig, TieredStore

NB = 100  # bytes per block in these tests


def blk(h: int, parent: int | None = None, payload: bytes | None = None) -> OffloadedBlock:
    return OffloadedBlock(h, parent, payload if payload is not None else bytes([h % 256]) * NB, NB)


def test_offload_to_host_and_onboard_keeps_copy():
    store = TieredStore(TierConfig(host_bytes=3 * NB))
    store.offload([blk(1), blk(2, 1), blk(3, 2)], now_s=0)
    assert store.take_events() == [BlockStored(parent_block_hash=None, block_hashes=[1, 2, 3], tier=KvTier.host)]
    assert store.lookup([1, 2, 3, 4]) == [KvTier.host] * 3
    got = store.onboard([1, 2, 9], now_s=1)
    assert [o.payload for o in got] == [bytes([1]) * NB, bytes([2]) * NB]
    assert store.num_blocks("host") == 3  # inclusive: G2 keeps its copy
    assert store.stats.onboarded_host_blocks == 2 and store.stats.onboarded_host_bytes == 2 * NB
    store.offload([blk(1)], now_s=2)  # evicted from G1 again: no copy, no event
    assert store.take_events() == [] and store.stats.offloaded_blocks == 3


def test_host_lru_eviction_never_exceeds_capacity():
    store = TieredStore(TierConfig(host_bytes=2 * NB + 50))
    for i in range(10):
        store.offload([blk(i)], now_s=i)
        assert store.host_used_bytes <= 2 * NB + 50
    assert store.num_blocks(KvTier.host) == 2 and store.tier_of(9) is KvTier.host and store.tier_of(7) is None
    events = store.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == list(range(8))


def test_demotion_needs_two_reuses():
    store = TieredStore(TierConfig(host_bytes=NB, disk_bytes=10 * NB), disk=MemoryDisk())
    store.offload([blk(1)], now_s=0)
    store.offload([blk(2)], now_s=0)  # pushes 1 out of G2: used once, not written
    assert store.tier_of(1) is None
    store.record_hits([2], now_s=0)  # one reuse: 2
    store.offload([blk(3)], now_s=0)
    assert store.tier_of(2) is None
    store.record_hits([3, 3], now_s=0)  # two reuses: 4
    store.offload([blk(4)], now_s=0)
    assert store.tier_of(3) is KvTier.disk
    assert store.stats.demoted_blocks == 1
    assert BlockStored(parent_block_hash=None, block_hashes=[3], tier=KvTier.disk) in store.take_events()


def test_frequency_decays_with_time():
    cfg = TierConfig(host_bytes=NB, disk_bytes=10 * NB, half_life_s=10)
    store = TieredStore(cfg, disk=MemoryDisk())
    store.offload([blk(1)], now_s=0)
    store.record_hits([1, 1], now_s=0)
    assert store.frequency(1, 0) == 4 and store.frequency(1, 10) == pytest.approx(2)
    store.offload([blk(2)], now_s=10)  # 1 leaves G2 with frequency 2 < 3
    assert store.tier_of(1) is None


def test_disk_capacity_and_lru():
    disk = MemoryDisk()
    store = TieredStore(TierConfig(host_bytes=0, disk_bytes=3 * (NB + 28)), disk=disk)
    for i in range(6):
        store.record_hits([i, i], now_s=0)
        store.offload([blk(i)], now_s=0)  # no host tier: straight to the disk filter
        assert store.disk_used_bytes <= store.config.disk_bytes
    assert sorted(disk.blobs) == [3, 4, 5] and store.num_blocks("disk") == 3


def test_corrupt_disk_block_is_never_served():
    disk = MemoryDisk()
    store = TieredStore(TierConfig(disk_bytes=10 * NB), disk=disk)
    for i, parent in ((1, None), (2, 1), (3, 2)):
        store.record_hits([i, i], 0)
        store.offload([blk(i, parent)], 0)
    store.take_events()
    disk.corrupt(2)
    got = store.onboard([1, 2, 3], now_s=1)
    assert [o.tier for o in got] == [KvTier.disk] and got[0].payload == bytes([1]) * NB
    assert store.stats.disk_corrupt_blocks == 1 and store.tier_of(2) is None and 2 not in disk.blobs
    assert store.take_events() == [BlockRemoved(block_hashes=[2], tier=KvTier.disk)]


def test_file_disk_atomic_checksummed(tmp_path):
    disk = FileDisk(tmp_path / "g3")
    store = TieredStore(TierConfig(disk_bytes=1 << 20), disk=disk)
    payloads = {h: random.Random(h).randbytes(NB) for h in (11, 12, 13)}
    for h, p in payloads.items():
        store.record_hits([h, h], 0)
        store.offload([blk(h, payload=p)], 0)
    files = sorted(p.name for p in (tmp_path / "g3").iterdir())
    assert files == [f"{h:016x}.kv" for h in (11, 12, 13)]  # no temporary files left
    assert [o.payload for o in store.onboard([11, 12, 13], 1)] == list(payloads.values())
    # Damage one file, delete another: both are recomputed, neither served.
    path = disk.path(12)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)
    assert [o.payload for o in store.onboard([11, 12], 2)] == [payloads[11]]
    disk.path(13).unlink()
    assert store.onboard([13], 3) == [] and store.stats.disk_corrupt_blocks == 2
    assert store.num_blocks("disk") == 1
    # A new store on the same directory starts empty (nothing indexes old files).
    FileDisk(tmp_path / "g3")
    assert list((tmp_path / "g3").iterdir()) == []


def test_random_workload_respects_capacities():
    rng = random.Random(7)
    cfg = TierConfig(host_bytes=5 * NB + 7, disk_bytes=8 * (NB + 28), half_life_s=50)
    store = TieredStore(cfg, disk=MemoryDisk())
    for t in range(2000):
        h = rng.randrange(40)
        op = rng.random()
        if op < 0.5:
            store.offload([blk(h)], t)
        elif op < 0.8:
            store.record_hits([h], t)
        else:
            for i, o in enumerate(store.onboard([h, h + 1], t)):
                assert o.payload == bytes([h + i]) * NB
        assert store.host_used_bytes <= cfg.host_bytes and store.disk_used_bytes <= cfg.disk_bytes
        assert store.host_used_bytes == store.num_blocks("host") * NB
    # Events replayed into sets give exactly what the store holds.
    held: dict[KvTier, set[int]] = {KvTier.host: set(), KvTier.disk: set()}
    for e in store.take_events():
        (held[e.tier].update if isinstance(e, BlockStored) else held[e.tier].difference_update)(e.block_hashes)
    assert held[KvTier.host] == store.held(KvTier.host) and held[KvTier.disk] == store.held(KvTier.disk)


def test_config_from_gb_and_validation():
    assert TierConfig.from_gb(1, 0.5).host_bytes == 1 << 30 and TierConfig.from_gb(1, 0.5).disk_bytes == 1 << 29
    assert not TierConfig().enabled and TierConfig(host_bytes=1).enabled
    with pytest.raises(ValueError):
        TierConfig(host_bytes=-1)
    with pytest.raises(ValueError):
        TierConfig(half_life_s=0)


def test_events_group_chains_whatever_the_eviction_order():
    store = TieredStore(TierConfig(host_bytes=10 * NB))
    store.offload([blk(3, 2), blk(2, 1), blk(1, None), blk(9, 8)], now_s=0)  # leaf first, and an orphan
    assert store.take_events() == [
        BlockStored(parent_block_hash=None, block_hashes=[1, 2, 3], tier=KvTier.host),
        BlockStored(parent_block_hash=8, block_hashes=[9], tier=KvTier.host),
    ]
