"""The paged KV block pool: prefix reuse, ref counts, LRU eviction, KV events, dump."""

from __future__ import annotations

import pytest

from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.schemas import AllBlocksCleared, BlockRemoved, BlockStored
from kvflow.workers.kv.blocks import BlockPool, NoFreeBlocks

BS = 4


def hashes(start: int, num_blocks: int, lora: str | None = None) -> list[int]:
    return compute_block_hashes(list(range(start, start + num_blocks * BS)), BS, lora)


def test_allocate_commit_emits_stored_with_parent():
    pool = BlockPool(8, BS)
    h = hashes(0, 3)
    assert pool.allocate("a", 10) == 0  # 10 tokens -> 3 blocks
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    pool.commit("a", h[:2])
    pool.commit("a", h[:3])
    pool.commit("a", h[:3])  # nothing new: no event
    assert pool.take_events() == [
        BlockStored(parent_block_hash=None, block_hashes=h[:2]),
        BlockStored(parent_block_hash=h[1], block_hashes=[h[2]]),
    ]
    assert pool.take_events() == []
    assert pool.num_cached_blocks == 3


def test_prefix_reuse_shares_blocks_and_counts_refs():
    pool = BlockPool(8, BS)
    h = hashes(0, 3)
    pool.allocate("a", 12)
    pool.commit("a", h)
    pool.take_events()
    assert pool.lookup(h) == 3
    assert pool.lookup([h[0], 999, h[2]]) == 1  # a prefix match stops at the first miss

    assert pool.allocate("b", 16, h) == 3  # 3 reused + 1 new
    assert pool.block_ids("b")[:3] == pool.block_ids("a")
    assert pool.num_used_blocks == 4  # shared blocks count once
    pool.free("a")
    assert pool.num_used_blocks == 4  # b still references them
    assert pool.num_free_blocks == 4
    pool.free("b")
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks == 8
    assert pool.lookup(h) == 3  # released but still cached
    assert pool.take_events() == []  # reuse and release change nothing the router sees


def test_lru_eviction_order_tail_first_and_oldest_release_first():
    pool = BlockPool(4, BS)
    ha, hb = hashes(0, 2), hashes(100, 2)
    pool.allocate("a", 8)
    pool.commit("a", ha)
    pool.allocate("b", 8)
    pool.commit("b", hb)
    pool.free("a")  # released first -> evicted first
    pool.free("b")
    pool.take_events()

    pool.allocate("c", 4)
    assert pool.take_events() == [BlockRemoved(block_hashes=[ha[1]])]  # a's tail before its head
    assert pool.lookup(ha) == 1
    pool.allocate("c", 12)
    assert pool.take_events() == [BlockRemoved(block_hashes=[ha[0], hb[1]])]
    assert pool.lookup(ha) == 0 and pool.lookup(hb) == 1


def test_reuse_refreshes_lru_position():
    pool = BlockPool(4, BS)
    ha, hb = hashes(0, 2), hashes(100, 2)
    for seq, h in (("a", ha), ("b", hb)):
        pool.allocate(seq, 8)
        pool.commit(seq, h)
    pool.free("a")
    pool.free("b")
    assert pool.allocate("a2", 4, ha[:1]) == 1  # touch a's head
    pool.free("a2")
    pool.take_events()
    pool.allocate("c", 12)  # needs 3: evicts a's tail, then b (tail first), not a's refreshed head
    assert pool.take_events() == [BlockRemoved(block_hashes=[ha[1], hb[1], hb[0]])]
    assert pool.lookup(ha) == 1


def test_out_of_blocks_leaves_pool_unchanged():
    pool = BlockPool(4, BS)
    h = hashes(0, 2)
    pool.allocate("a", 8)
    pool.commit("a", h)
    pool.free("a")
    pool.take_events()
    pool.allocate("x", 8)  # takes the 2 never-used blocks
    with pytest.raises(NoFreeBlocks) as info:
        # 2 hits sit on the LRU list; taking them leaves 0 free for the 1 new block.
        pool.allocate("b", 12, h)
    assert info.value.needed == 1 and info.value.available == 0
    assert not pool.has_seq("b")
    assert pool.lookup(h) == 2 and pool.num_used_blocks == 2
    assert pool.take_events() == []
    pool.allocate("b", 8, h)  # fits exactly with the hits
    assert pool.num_used_blocks == 4


def test_growing_a_sequence_evicts_and_events_keep_order():
    pool = BlockPool(3, BS)
    h = hashes(0, 2)
    pool.allocate("a", 8)
    pool.commit("a", h)
    pool.free("a")
    pool.allocate("b", 4)  # takes the never-used block
    pool.allocate("b", 8)  # grows: evicts a's tail
    pool.allocate("b", 12)  # grows: evicts a's head
    hb = hashes(50, 3)
    pool.commit("b", hb)
    assert pool.take_events() == [
        BlockStored(parent_block_hash=None, block_hashes=h),
        BlockRemoved(block_hashes=[h[1]]),
        BlockRemoved(block_hashes=[h[0]]),
        BlockStored(parent_block_hash=None, block_hashes=hb),
    ]
    assert pool.num_seq_blocks("b") == 3


def test_duplicate_prefix_computed_concurrently_is_stored_once():
    pool = BlockPool(8, BS)
    h = hashes(0, 2)
    pool.allocate("a", 8)
    pool.allocate("b", 8)  # both miss: neither was committed yet
    pool.commit("a", h)
    pool.commit("b", h)
    assert pool.take_events() == [BlockStored(parent_block_hash=None, block_hashes=h)]
    pool.free("b")  # b's copies are unnamed: straight back to free
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 2
    pool.free("a")
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 2


def test_lora_name_travels_on_stored_events():
    pool = BlockPool(4, BS)
    h = hashes(0, 1, lora="ad")
    pool.allocate("a", 4)
    pool.commit("a", h, lora_name="ad")
    assert pool.take_events() == [BlockStored(parent_block_hash=None, block_hashes=h, lora_name="ad")]


def test_dump_describes_cache_in_chains():
    pool = BlockPool(6, BS)
    ha, hb = hashes(0, 3), hashes(100, 2)
    pool.allocate("a", 12)
    pool.commit("a", ha)
    pool.allocate("b", 8)
    pool.commit("b", hb)
    pending = pool.take_events()
    assert pool.dump() == pending  # two chains, in commit order
    pool.free("a")
    pool.allocate("c", 8)  # 1 free block + evicts a's tail
    dump = pool.dump()
    assert dump == [
        BlockStored(parent_block_hash=None, block_hashes=ha[:2]),
        BlockStored(parent_block_hash=None, block_hashes=hb),
    ]
    assert {h for e in dump for h in e.block_hashes} == {*ha[:2], *hb}
    assert pool.take_events() == [BlockRemoved(block_hashes=[ha[2]])]  # dump leaves pending events alone


def test_dump_keeps_orphans_with_their_parent():
    pool = BlockPool(3, BS)
    h = hashes(0, 3)
    pool.allocate("a", 12)
    pool.commit("a", h)
    pool.free("a")  # release order: h2, h1, h0
    pool.allocate("x", 4)  # evicts h2 (tail)
    pool.free("x")
    pool.allocate("y", 4, h[:1])  # reuse h0; h1 keeps its parent link
    assert pool.dump() == [BlockStored(parent_block_hash=None, block_hashes=h[:2])]


def test_reset_clears_everything():
    pool = BlockPool(4, BS)
    pool.allocate("a", 8)
    pool.commit("a", hashes(0, 2))
    pool.take_events()
    pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 4 and pool.num_cached_blocks == 0
    assert pool.dump() == []


def test_prefix_caching_disabled_has_no_hits_and_no_events():
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    h = hashes(0, 2)
    pool.allocate("a", 8)
    pool.commit("a", h)
    pool.free("a")
    assert pool.lookup(h) == 0
    assert pool.allocate("b", 8, h) == 0
    assert pool.take_events() == [] and pool.dump() == []
    assert pool.num_free_blocks == 2


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    pool = BlockPool(4, BS)
    pool.allocate("a", 4)
    with pytest.raises(ValueError):
        pool.commit("a", hashes(0, 2))  # more hashes than blocks
    with pytest.raises(KeyError):
        pool.commit("nope", hashes(0, 1))
    pool.free("nope")  # unknown: no-op
