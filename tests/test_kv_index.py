"""The global KV index: events, event ids, dumps, tiers, prefix matching.

Every test runs twice: on the compiled block map and on its pure-Python twin.
"""

from __future__ import annotations

import random

import pytest

from kvflow.schemas.block_hash import BlockSizeMismatch, compute_block_hashes
from kvflow.router import _blockmap_py
from kvflow.router import index as index_mod
from kvflow.router.index import KvIndex
from kvflow.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvTier,
)
from kvflow.workers.kv.blocks import BlockPool

BS = 4


@pytest.fixture(autouse=True, params=["compiled", "python"])
def block_map(request, monkeypatch):
    """Run the test with ``KvIndex``'s default map set to the compiled or the Python one."""
    if request.param == "compiled":
        if not index_mod.COMPILED:
            pytest.skip("kvflow.router._blockmap was not built")
        from kvflow.router._blockmap import BlockMap
    else:
        BlockMap = _blockmap_py.BlockMap
    monkeypatch.setattr(index_mod, "BlockMap", BlockMap)
    return BlockMap


def batch(worker: str, event_id: int, *events, dump: bool = False, block_size: int = BS) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, event_id=event_id, block_size=block_size, ts_ms=0, events=list(events),
                        dump=dump)


def stored(*hashes: int, parent: int | None = None, tier: KvTier = KvTier.device) -> BlockStored:
    return BlockStored(parent_block_hash=parent, block_hashes=list(hashes), tier=tier)


def removed(*hashes: int, tier: KvTier = KvTier.device) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), tier=tier)


PROMPT = compute_block_hashes(list(range(40)), BS)  # 10 chained block hashes


def test_stored_blocks_give_prefix_overlap_per_worker():
    idx = KvIndex(BS)
    idx.apply(batch("a", 0, stored(*PROMPT[:6])))
    idx.apply(batch("b", 0, stored(*PROMPT[:2])))
    idx.apply(batch("c", 0, stored(*compute_block_hashes(list(range(100, 140)), BS))))
    scores = idx.find_matches(PROMPT)
    assert dict(scores.device) == {"a": 6, "b": 2}
    assert dict(scores.host) == {} and dict(scores.disk) == {}
    assert scores.prefix("a") == 6 and scores.prefix("c") == 0
    assert idx.find_matches([]).device == {}
    assert idx.workers() == ["a", "b", "c"]
    assert idx.num_blocks("a") == 6


def test_prefix_stops_at_first_missing_block():
    idx = KvIndex(BS)
    # block 3 missing: blocks 4.. are held but unreachable by prefix matching
    idx.apply(batch("a", 0, stored(*PROMPT[:3]), stored(*PROMPT[4:], parent=PROMPT[3])))
    assert dict(idx.find_matches(PROMPT).device) == {"a": 3}
    # once the hole is filled the rest counts again
    idx.apply(batch("a", 1, stored(PROMPT[3], parent=PROMPT[2])))
    assert dict(idx.find_matches(PROMPT).device) == {"a": 10}
    # a worker missing block 0 has no overlap at all
    idx.apply(batch("b", 0, stored(*PROMPT[1:], parent=PROMPT[0])))
    assert "b" not in idx.find_matches(PROMPT).device


def test_removed_and_cleared():
    idx = KvIndex(BS)
    idx.apply(batch("a", 0, stored(*PROMPT)))
    idx.apply(batch("b", 0, stored(*PROMPT)))
    idx.apply(batch("a", 1, removed(*PROMPT[7:])))
    assert dict(idx.find_matches(PROMPT).device) == {"a": 7, "b": 10}
    idx.apply(batch("a", 2, removed(12345)))  # unknown block: ignored
    idx.apply(batch("b", 1, AllBlocksCleared()))
    assert dict(idx.find_matches(PROMPT).device) == {"a": 7}
    assert idx.num_blocks("b") == 0 and "b" in idx.workers()
    # storing again after a clear works
    idx.apply(batch("b", 2, stored(*PROMPT[:1])))
    assert dict(idx.find_matches(PROMPT).device) == {"a": 7, "b": 1}


def test_duplicate_and_out_of_order_batches_are_ignored():
    idx = KvIndex(BS)
    assert idx.apply(batch("a", 0, stored(*PROMPT[:4]))).applied
    r = idx.apply(batch("a", 1, removed(PROMPT[3])))
    assert r.applied and not r.gap and r.expected_event_id == 1
    dup = idx.apply(batch("a", 1, removed(*PROMPT[:4])))  # redelivered id 1 with other content
    assert dup.duplicate and not dup.applied and dup.expected_event_id == 2
    late = idx.apply(batch("a", 0, stored(*PROMPT)))  # an old batch arriving late
    assert late.duplicate
    assert dict(idx.find_matches(PROMPT).device) == {"a": 3}
    assert idx.last_event_id("a") == 1
    assert idx.workers_needing_dump() == []


def test_gap_is_reported_applied_and_cleared_by_a_dump():
    idx = KvIndex(BS)
    idx.apply(batch("a", 0, stored(*PROMPT[:2])))
    r = idx.apply(batch("a", 3, stored(*PROMPT[2:5], parent=PROMPT[1])))
    assert r.gap and r.applied and r.expected_event_id == 1
    assert idx.workers_needing_dump() == ["a"]
    assert dict(idx.find_matches(PROMPT).device) == {"a": 5}  # keeps what it has, plus the new batch
    nxt = idx.apply(batch("a", 4, stored(PROMPT[5], parent=PROMPT[4])))
    assert not nxt.gap  # contiguous after the gap
    assert idx.workers_needing_dump() == ["a"]  # still waiting for the dump
    # the dump replaces the worker's state entirely and resets the cursor
    d = idx.apply(batch("a", 2, stored(*PROMPT[:8]), dump=True))
    assert d.applied and not d.gap
    assert idx.workers_needing_dump() == []
    assert idx.last_event_id("a") == 2
    assert dict(idx.find_matches(PROMPT).device) == {"a": 8}
    assert idx.apply(batch("a", 3, removed(PROMPT[7]))).applied  # ids continue from the dump
    assert dict(idx.find_matches(PROMPT).device) == {"a": 7}


def test_dump_drops_blocks_not_in_it():
    idx = KvIndex(BS)
    other = compute_block_hashes(list(range(500, 520)), BS)
    idx.apply(batch("a", 0, stored(*other), stored(*PROMPT[:3], tier=KvTier.host)))
    idx.apply(batch("a", 1, stored(*PROMPT[:2]), dump=True))
    assert idx.find_matches(other).workers() == set()
    assert dict(idx.find_matches(PROMPT).device) == {"a": 2}
    assert dict(idx.find_matches(PROMPT).host) == {}
    assert idx.num_blocks("a", "host") == 0


def test_first_batch_mid_stream_is_flagged_as_gap():
    idx = KvIndex(BS)
    r = idx.apply(batch("a", 7, stored(*PROMPT[:1])))
    assert r.applied and r.gap and r.expected_event_id is None
    assert idx.workers_needing_dump() == ["a"]
    assert not idx.apply(batch("b", 0, stored(*PROMPT[:1]))).gap


def test_block_size_mismatch_raises():
    idx = KvIndex(BS)
    with pytest.raises(BlockSizeMismatch, match="block size 16"):
        idx.apply(batch("a", 0, stored(*PROMPT), block_size=16))
    assert issubclass(BlockSizeMismatch, ValueError)
    assert idx.workers() == [] and idx.last_event_id("a") is None
    with pytest.raises(ValueError):
        KvIndex(0)


def test_tiers_are_disjoint_and_fastest_first():
    idx = KvIndex(BS)
    idx.apply(batch("a", 0, stored(*PROMPT[:3]), stored(*PROMPT[2:6], tier=KvTier.host),
                    stored(*PROMPT[6:8], tier=KvTier.disk)))
    idx.apply(batch("b", 0, stored(*PROMPT[:4], tier=KvTier.disk)))
    idx.apply(batch("c", 0, stored(*PROMPT[:5])))
    s = idx.find_matches(PROMPT)
    # a: 0-2 device (2 also on host counts as device), 3-5 host, 6-7 disk
    assert (s.device.get("a"), s.host.get("a"), s.disk.get("a")) == (3, 3, 2)
    assert ("b" in s.device, s.disk.get("b")) == (False, 4)
    assert s.device.get("c") == 5 and "c" not in s.host
    assert s.prefix("a") == 8
    # evicting from device falls back to the host copy; the prefix continues
    idx.apply(batch("a", 1, removed(PROMPT[2])))
    s = idx.find_matches(PROMPT)
    assert (s.device.get("a"), s.host.get("a"), s.disk.get("a")) == (2, 4, 2)
    # a block in no tier ends the prefix
    idx.apply(batch("a", 2, removed(PROMPT[4], tier=KvTier.host)))
    s = idx.find_matches(PROMPT)
    assert (s.device.get("a"), s.host.get("a"), s.disk.get("a")) == (2, 2, None)
    # once lower tiers empty out the device-only path gives the same answers
    idx.apply(batch("a", 3, removed(*PROMPT, tier=KvTier.host), removed(*PROMPT, tier=KvTier.disk)))
    idx.apply(batch("b", 1, AllBlocksCleared()))
    s = idx.find_matches(PROMPT)
    assert dict(s.device) == {"a": 2, "c": 5} and dict(s.host) == {} and dict(s.disk) == {}


def test_remove_worker_forgets_blocks_and_cursor():
    idx = KvIndex(BS)
    idx.apply(batch("a", 5, stored(*PROMPT)))
    idx.apply(batch("b", 0, stored(*PROMPT[:2])))
    idx.remove_worker("a")
    assert idx.workers() == ["b"] and idx.workers_needing_dump() == []
    assert dict(idx.find_matches(PROMPT).device) == {"b": 2}
    # a restarted worker under the same id starts again at event 0
    assert not idx.apply(batch("a", 0, stored(*PROMPT[:1]))).gap
    assert dict(idx.find_matches(PROMPT).device) == {"a": 1, "b": 2}
    idx.remove_worker("nobody")  # no-op


def _random_batches(seed: int, workers: int = 4, steps: int = 300) -> list[KvEventBatch]:
    """A random but valid event stream over a few prompt families."""
    rng = random.Random(seed)
    families = [compute_block_hashes([f * 1000 + t for t in range(48)], BS) for f in range(5)]
    ids = [0] * workers
    out = []
    for _ in range(steps):
        w = rng.randrange(workers)
        fam = rng.choice(families)
        a = rng.randrange(len(fam))
        b = rng.randrange(a, len(fam)) + 1
        tier = rng.choice([KvTier.device, KvTier.device, KvTier.host, KvTier.disk])
        r = rng.random()
        if r < 0.55:
            ev = stored(*fam[a:b], parent=fam[a - 1] if a else None, tier=tier)
        elif r < 0.95:
            ev = removed(*rng.sample(fam, rng.randrange(1, 6)), tier=tier)
        else:
            ev = AllBlocksCleared()
        out.append(batch(f"w{w}", ids[w], ev))
        ids[w] += 1
    return out


def _reference(batches: list[KvEventBatch]) -> dict[str, list[set[int]]]:
    """Per-worker per-tier block sets, by brute force."""
    ref: dict[str, list[set[int]]] = {}
    order = [KvTier.device, KvTier.host, KvTier.disk]
    for b in batches:
        tiers = ref.setdefault(b.worker_id, [set(), set(), set()])
        for ev in b.events:
            if isinstance(ev, BlockStored):
                tiers[order.index(ev.tier)].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                tiers[order.index(ev.tier)].difference_update(ev.block_hashes)
            else:
                for t in tiers:
                    t.clear()
    return ref


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_matches_a_brute_force_model(seed):
    batches = _random_batches(seed)
    idx = KvIndex(BS)
    for b in batches:
        assert idx.apply(b).applied
    ref = _reference(batches)
    families = [compute_block_hashes([f * 1000 + t for t in range(48)], BS) for f in range(5)]
    for prompt in families + [f[:7] for f in families]:
        got = idx.find_matches(prompt)
        for w, (dev, host, disk) in ref.items():
            n_dev = n_host = n_disk = 0
            for h in prompt:
                if h in dev:
                    n_dev += 1
                elif h in host:
                    n_host += 1
                elif h in disk:
                    n_disk += 1
                else:
                    break
            assert (got.device.get(w, 0), got.host.get(w, 0), got.disk.get(w, 0)) == (n_dev, n_host, n_disk)


def test_replicas_fed_the_same_batches_are_equal():
    batches = _random_batches(7)
    a, b = KvIndex(BS), KvIndex(BS)
    for x in batches:
        a.apply(x)
        b.apply(x)
    assert a == b and a.snapshot() == b.snapshot()
    b.apply(batch("w0", 10_000, stored(999_999)))
    assert a != b
    assert a != KvIndex(BS + 1)


def test_rebuild_from_worker_dumps_equals_the_live_index():
    """Real block pools publish events; a restarted router rebuilds from their dumps."""
    pools = {f"w{i}": BlockPool(num_blocks=24, block_size=BS) for i in range(3)}
    live = KvIndex(BS)
    ids = dict.fromkeys(pools, 0)
    rng = random.Random(5)
    prompts = [compute_block_hashes([p * 97 + t for t in range(32)], BS) for p in range(6)]
    for step in range(60):
        w = rng.choice(list(pools))
        pool = pools[w]
        seq = f"r{step}"
        hashes = rng.choice(prompts)
        n = rng.randrange(2, len(hashes) + 1)
        pool.allocate(seq, n * BS, hashes[:n])
        pool.commit(seq, hashes[:n])
        pool.free(seq)
        events = pool.take_events()
        if events:
            live.apply(batch(w, ids[w], *events))
            ids[w] += 1
    rebuilt = KvIndex(BS)
    for w, pool in pools.items():
        rebuilt.apply(batch(w, ids[w] - 1, *pool.dump(), dump=True))
    assert rebuilt.snapshot()["workers"] == live.snapshot()["workers"]
    assert rebuilt == live
    for p in prompts:  # and the index agrees with each pool's own prefix lookup
        assert {w: pool.lookup(p) for w, pool in pools.items() if pool.lookup(p)} == dict(live.find_matches(p).device)


def test_on_kv_events_applies_without_ids():
    idx = KvIndex(BS)
    idx.on_kv_events("a", [stored(*PROMPT[:3]), removed(PROMPT[2])])
    assert dict(idx.find_matches(PROMPT).device) == {"a": 2}
    assert idx.last_event_id("a") is None


def test_more_than_64_workers_span_several_maps_and_slots_are_reused(block_map):
    idx = KvIndex(BS)
    for w in range(70):  # two groups of 64 slots
        idx.store_blocks(f"w{w:02d}", PROMPT[: 1 + w % 10])
    got = idx.find_matches(PROMPT).device
    assert got == {f"w{w:02d}": 1 + w % 10 for w in range(70)}
    assert len(idx._maps) == 2 and all(isinstance(m[0], block_map) for m in idx._maps)
    idx.remove_worker("w03")
    idx.remove_worker("w66")
    assert "w03" not in idx.find_matches(PROMPT).device and "w66" not in idx.find_matches(PROMPT).device
    idx.store_blocks("new", PROMPT[:2])  # takes the lowest free slot, which held w03: no stale blocks
    assert idx._slot["new"] == 3
    assert idx.find_matches(PROMPT).device["new"] == 2 and idx.num_blocks("new") == 2
    assert idx.held("new") == set(PROMPT[:2]) and idx.held("w66") == set()


def test_orphan_blocks_are_held_but_not_counted():
    idx = KvIndex(BS)
    idx.store_blocks("a", PROMPT[2:6])  # parent blocks 0..1 never stored
    assert idx.num_blocks("a") == 4 and idx.find_matches(PROMPT).device == {}
    idx.store_blocks("a", PROMPT[:2])  # the parents arrive: the whole run counts
    assert dict(idx.find_matches(PROMPT).device) == {"a": 6}


def test_out_of_range_hashes_are_refused_and_change_nothing():
    idx = KvIndex(BS)
    idx.store_blocks("a", PROMPT[:3])
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="block hash"):
            idx.store_blocks("a", [PROMPT[3], bad])
        with pytest.raises(ValueError, match="block hash"):
            idx.remove_blocks("a", [PROMPT[0], bad])
        with pytest.raises(ValueError, match="block hash"):
            idx.find_matches([PROMPT[0], bad])
    assert idx.held("a") == set(PROMPT[:3])
    with pytest.raises(ValueError):  # the schema refuses them before they reach the index
        stored(2**64)


def test_tiered_matches_agree_with_a_naive_walk():
    import random

    rng = random.Random(11)
    idx = KvIndex(16)
    held: dict[str, dict[int, KvTier]] = {}
    prompts = [[rng.getrandbits(64) for _ in range(30)] for _ in range(6)]
    for w in ("a", "b", "c", "d"):
        held[w] = {}
        for p in prompts:
            for h in p[:rng.randrange(31)]:
                tiers = [t for t in KvTier if rng.random() < 0.5]
                for t in tiers:
                    idx.store_blocks(w, [h], t)
                if tiers:
                    held[w][h] = min(tiers, key=list(KvTier).index)  # the fastest tier holding it
    for p in prompts:
        scores = idx.find_matches(p)
        for w, blocks in held.items():
            want = {t: 0 for t in KvTier}
            for h in p:
                if h not in blocks:
                    break
                want[blocks[h]] += 1
            got = {KvTier.device: scores.device.get(w, 0), KvTier.host: scores.host.get(w, 0),
                   KvTier.disk: scores.disk.get(w, 0)}
            assert got == want, (w, got, want)
