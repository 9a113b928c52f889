"""vLLM KV events → kvflow KV events: decoding, translation, the ZeroMQ subscriber.

Payloads are built here the way vLLM's publisher lays them out
(vllm-project/vllm, ``vllm/distributed/kv_events.py``):

* ``ZmqEventPublisher._publisher_thread`` sends three frames
  ``(topic_bytes, seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch))``;
* ``EventBatch(ts: float, events: list, data_parallel_rank: int | None = None)``
  and ``KVCacheEvent(tag=True, omit_defaults=True)`` subclasses
  ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys=None, group_idx=None,
  kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None)``,
  ``BlockRemoved(block_hashes, medium, group_idx=None)``, ``AllBlocksCleared()``;
* with ``array_like=True`` (commit b4e69e0 and releases before
  vllm-project/vllm#42892) a struct is the array ``[tag, *fields]`` with
  every declared field written (msgspec's ``omit_defaults`` does not shorten
  arrays; older releases simply declared fewer fields, e.g. b4e69e0's
  five-field ``BlockStored``); without it (commit 0181ea31) a map
  ``{"type": tag, field: value, ...}`` with defaulted keys omitted. vLLM
  0.26 was observed sending the array batch with map events
  (``[ts, [{"type": "BlockStored", ...}], 0]``, volcano-sh/kthena#1535);
* ``BlockStored.token_ids`` are the new blocks' tokens and
  ``parent_block_hash`` vLLM's hash of the block before them
  (``BlockPool.cache_full_blocks`` in ``vllm/v1/core/block_pool.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os

import pytest

from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.router.index import KvIndex
from kvflow.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvTier,
)
from kvflow.workers.engines.vllm_kv_events import (
    KvEventTranslator,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventDecodeError,
    VllmKvEventSubscriber,
    decode_vllm_event_batch,
    medium_to_tier,
    new_ipc_endpoint,
)

HAS_MSGPACK = importlib.util.find_spec("msgpack") is not None
HAS_MSGSPEC = importlib.util.find_spec("msgspec") is not None
HAS_ZMQ = importlib.util.find_spec("zmq") is not None

if not (HAS_MSGPACK or HAS_MSGSPEC):
    pytest.skip("building vLLM-shaped payloads needs msgpack or msgspec", allow_module_level=True)

BS = 16
TOKENS = list(range(1000, 1000 + 6 * BS))  # 6 full blocks of distinct tokens


def packb(obj) -> bytes:
    """Plain msgpack encoding (what msgspec produces for lists, maps, ints, bytes, str, None, float)."""
    if HAS_MSGPACK:
        import msgpack

        return msgpack.packb(obj, use_bin_type=True)
    import msgspec

    return msgspec.msgpack.encode(obj)


# ---- vLLM layouts --------------------------------------------------------------


def stored_array(hashes, parent, tokens, block_size=BS, lora_id=None, medium="GPU", lora_name=None, **tail):
    """``BlockStored`` as ``array_like=True`` encodes it: the tag, then all 11 fields in declaration order."""
    optional = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    return ["BlockStored", list(hashes), parent, list(tokens), block_size, lora_id, medium, lora_name] + [
        tail.get(name) for name in optional]


def stored_map(hashes, parent, tokens, block_size=BS, lora_id=None, medium="GPU", lora_name=None, **tail):
    """``BlockStored`` as a tagged map (vLLM after #42892); None defaults omitted."""
    event = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
             "token_ids": list(tokens), "block_size": block_size, "lora_id": lora_id, "medium": medium,
             "lora_name": lora_name}
    event.update({k: v for k, v in tail.items() if v is not None})
    return event


def removed_array(hashes, medium="GPU", group_idx=None):
    """``BlockRemoved`` as ``array_like=True`` encodes it (all 3 fields)."""
    return ["BlockRemoved", list(hashes), medium, group_idx]


def removed_map(hashes, medium="GPU", group_idx=None):
    event = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def batch_array(events, ts=1.5, rank=None):
    """``EventBatch`` with ``array_like=True``: ``[ts, events, data_parallel_rank]``."""
    return packb([ts, events, rank])


def batch_map(events, ts=1.5, rank=None):
    """``EventBatch`` without ``array_like``: a map, the None rank omitted."""
    body = {"ts": ts, "events": events}
    if rank is not None:
        body["data_parallel_rank"] = rank
    return packb(body)


# ---- decoding ---------------------------------------------------------------------


def test_decode_legacy_positional_layout():
    # b4e69e0's layout: a two-field batch and five-field BlockStored, one-field BlockRemoved.
    old = decode_vllm_event_batch(packb([0.5, [["BlockStored", [1], None, TOKENS[:BS], BS, None],
                                               ["BlockRemoved", [1]], ["AllBlocksCleared"]]]))
    assert old.ts == 0.5 and old.data_parallel_rank is None
    assert old.events == (VllmBlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=tuple(TOKENS[:BS]),
                                          block_size=BS), VllmBlockRemoved(block_hashes=(1,)), VllmAllBlocksCleared())
    # The last positional layout: every field of the 11-field BlockStored written.
    payload = batch_array([
        stored_array([11, 12], None, TOKENS[: 2 * BS], group_idx=0, kv_cache_spec_kind="full_attention"),
        stored_array([13], 12, TOKENS[2 * BS: 3 * BS], lora_id=2, lora_name="sql"),
        removed_array([11], group_idx=0),
        ["AllBlocksCleared"],
    ], ts=12.25, rank=0)
    batch = decode_vllm_event_batch(payload)
    assert batch.ts == 12.25 and batch.data_parallel_rank == 0 and batch.num_unknown_events == 0
    first, second, removed, cleared = batch.events
    assert first == VllmBlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(TOKENS[:32]),
                                    block_size=BS, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")
    assert (second.parent_block_hash, second.lora_id, second.lora_name) == (12, 2, "sql")
    assert removed == VllmBlockRemoved(block_hashes=(11,), medium="GPU", group_idx=0)
    assert cleared == VllmAllBlocksCleared()


def test_decode_map_events_in_positional_batch():
    # The shape captured from vLLM 0.26 (bytes hashes are what newer sha256 hashing can publish).
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = batch_array([
        stored_map([h1, h2], None, TOKENS[:32], extra_keys=[None, None], group_idx=0,
                   kv_cache_spec_kind="full_attention"),
        removed_map([h1], group_idx=0),
        {"type": "AllBlocksCleared"},
    ], rank=0)
    stored, removed, cleared = decode_vllm_event_batch(payload).events
    assert stored.block_hashes == (h1, h2) and stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention" and stored.medium == "GPU"
    assert removed == VllmBlockRemoved(block_hashes=(h1,), medium="GPU", group_idx=0)
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_decode_map_batch():
    payload = batch_map([stored_map([7], None, TOKENS[:BS], medium="CPU")], ts=3.0)
    batch = decode_vllm_event_batch(payload)
    assert batch.ts == 3.0 and batch.data_parallel_rank is None
    assert batch.events[0].medium == "CPU" and batch.events[0].token_ids == tuple(TOKENS[:BS])


def test_decode_skips_unknown_event_types_and_extra_fields():
    payload = batch_array([
        ["BlockPinned", [1]],  # an event type this module does not know
        {"type": "BlockUpdated", "block_hashes": [1]},
        # All known fields, then two fields a newer vLLM might append.
        stored_array([5], None, TOKENS[:BS], extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention",
                     kv_cache_spec_sliding_window=4096) + [None, "future"],
    ])
    batch = decode_vllm_event_batch(payload)
    assert batch.num_unknown_events == 2
    assert [type(e) for e in batch.events] == [VllmBlockStored]
    assert batch.events[0].kv_cache_spec_kind == "full_attention"


@pytest.mark.parametrize("payload", [
    b"\xc1",  # never-used msgpack byte
    packb("not a batch"),
    packb([1.0, "events"]),
    packb(["ts", []]),
    packb([1.0, [["BlockStored", "nohashes", None, [], 16, None, "GPU", None]]]),
    packb([1.0, [["BlockStored", [1], None, [1, 2], 0, None, "GPU", None]]]),
    packb([1.0, [["BlockStored", [1], None, ["x"], 16, None, "GPU", None]]]),
    packb([1.0, [42]]),
])
def test_decode_rejects_malformed_payloads(payload):
    with pytest.raises(VllmEventDecodeError):
        decode_vllm_event_batch(payload)


def test_medium_to_tier():
    assert medium_to_tier(None) is KvTier.device
    assert medium_to_tier("GPU") is KvTier.device
    assert medium_to_tier("cpu") is KvTier.host and medium_to_tier("CPU_PINNED") is KvTier.host
    assert medium_to_tier("DISK") is KvTier.disk and medium_to_tier("LocalDisk") is KvTier.disk
    assert medium_to_tier("tape") is None


# ---- translation ------------------------------------------------------------------


def translate(translator: KvEventTranslator, *events, layout=batch_array):
    return translator.translate_payload(layout(list(events)))


@pytest.mark.parametrize("layout,stored,removed", [
    (batch_array, stored_array, removed_array),
    (batch_array, stored_map, removed_map),
    (batch_map, stored_map, removed_map),
])
def test_stored_hashes_are_recomputed_with_kvflow_hashing(layout, stored, removed):
    tr = KvEventTranslator(BS)
    expected = compute_block_hashes(TOKENS, BS)
    # vLLM's own hashes (arbitrary here) are never what kvflow publishes.
    out = translate(tr, stored([901, 902, 903], None, TOKENS[: 3 * BS]), layout=layout)
    assert out == [BlockStored(parent_block_hash=None, block_hashes=expected[:3], tier=KvTier.device)]
    # A continuation names vLLM's parent hash; kvflow's chain continues from kvflow's parent hash.
    out = translate(tr, stored([904, 905, 906], 903, TOKENS[3 * BS:]), layout=layout)
    assert out == [BlockStored(parent_block_hash=expected[2], block_hashes=expected[3:], tier=KvTier.device)]
    assert tr.kvflow_hashes(905) == (expected[4],)
    # Removal carries only vLLM hashes; the map translates them.
    out = translate(tr, removed([906, 905]), layout=layout)
    assert out == [BlockRemoved(block_hashes=[expected[5], expected[4]], tier=KvTier.device)]
    assert tr.kvflow_hashes(905) is None and len(tr) == 4
    assert tr.stats.stored_blocks == 6 and tr.stats.removed_blocks == 2 and tr.stats.unknown_removed == 0


def test_unknown_hash_in_removal_is_ignored_and_counted():
    tr = KvEventTranslator(BS)
    expected = compute_block_hashes(TOKENS[: 2 * BS], BS)
    translate(tr, stored_array([1, 2], None, TOKENS[: 2 * BS]))
    out = translate(tr, removed_array([2, 999]))
    assert out == [BlockRemoved(block_hashes=[expected[1]], tier=KvTier.device)]
    assert tr.stats.unknown_removed == 1
    # Only unknown hashes (including one already removed): no kvflow event at all.
    assert translate(tr, removed_array([2, 12345])) == []
    assert tr.stats.unknown_removed == 3


def test_unknown_parent_is_skipped_and_counted():
    tr = KvEventTranslator(BS)
    assert translate(tr, stored_array([5], 4, TOKENS[BS: 2 * BS])) == []
    assert tr.stats.unknown_parent == 1 and len(tr) == 0


def test_cleared_forgets_everything():
    tr = KvEventTranslator(BS)
    translate(tr, stored_array([1, 2], None, TOKENS[: 2 * BS]))
    assert translate(tr, ["AllBlocksCleared"]) == [AllBlocksCleared()]
    assert len(tr) == 0 and tr.num_held() == 0 and tr.stats.cleared == 1
    assert translate(tr, removed_array([1])) == []
    assert tr.stats.unknown_removed == 1
    assert translate(tr, stored_array([3], 2, TOKENS[2 * BS: 3 * BS])) == []
    assert tr.stats.unknown_parent == 1


def test_duplicate_copies_are_reference_counted():
    # vLLM does not de-duplicate: two requests computing the same block cache two copies,
    # and each eviction removes one. kvflow removes the block when the last copy goes.
    tr = KvEventTranslator(BS)
    h = compute_block_hashes(TOKENS[:BS], BS)[0]
    translate(tr, stored_array([1], None, TOKENS[:BS]))
    translate(tr, stored_array([1], None, TOKENS[:BS]))
    assert translate(tr, removed_array([1])) == []
    assert translate(tr, removed_array([1])) == [BlockRemoved(block_hashes=[h])]
    # Two vLLM hashes (e.g. different cache salts) for the same tokens share one kvflow hash.
    translate(tr, stored_array([1], None, TOKENS[:BS]), stored_array([77], None, TOKENS[:BS]))
    assert translate(tr, removed_array([77])) == []
    assert translate(tr, removed_array([1])) == [BlockRemoved(block_hashes=[h])]


def test_tiers_follow_medium_and_untokenized_copies_reuse_the_mapping():
    tr = KvEventTranslator(BS)
    expected = compute_block_hashes(TOKENS[: 2 * BS], BS)
    translate(tr, stored_array([1, 2], None, TOKENS[: 2 * BS]))
    # An offload of the same blocks to host memory, announced without tokens.
    out = translate(tr, stored_map([1, 2], None, [], medium="CPU"))
    assert out == [BlockStored(parent_block_hash=None, block_hashes=expected, tier=KvTier.host)]
    # Evicting the device copies leaves the host copies.
    out = translate(tr, removed_array([1, 2], medium="GPU"))
    assert out == [BlockRemoved(block_hashes=expected, tier=KvTier.device)]
    assert tr.kvflow_hashes(1) == (expected[0],) and tr.num_held(KvTier.host) == 2
    assert translate(tr, removed_array([1], medium="GPU")) == [] and tr.stats.unknown_removed == 1
    # Unknown medium, and an untokenized store of a never-seen hash, are skipped.
    assert translate(tr, stored_array([3], 2, TOKENS[2 * BS: 3 * BS], medium="tape")) == []
    assert translate(tr, stored_map([42], None, [], medium="CPU")) == []
    assert tr.stats.skipped_medium == 1 and tr.stats.unknown_untokenized == 1


def test_larger_vllm_blocks_split_into_kvflow_blocks():
    tr = KvEventTranslator(8)  # kvflow blocks of 8 tokens, vLLM blocks of 16
    expected = compute_block_hashes(TOKENS[: 4 * BS], 8)
    out = translate(tr, stored_array([1, 2], None, TOKENS[: 2 * BS]))
    assert out == [BlockStored(block_hashes=expected[:4])]
    out = translate(tr, stored_array([3], 2, TOKENS[2 * BS: 3 * BS]))
    assert out == [BlockStored(parent_block_hash=expected[3], block_hashes=expected[4:6])]
    assert translate(tr, removed_array([2])) == [BlockRemoved(block_hashes=expected[2:4])]
    # A vLLM block size that kvflow's does not divide cannot be re-hashed.
    assert translate(KvEventTranslator(BS), stored_array([9], None, TOKENS[:24], block_size=24)) == []


def test_lora_name_salts_hashes_and_lora_id_alone_is_skipped():
    tr = KvEventTranslator(BS)
    out = translate(tr, stored_array([1], None, TOKENS[:BS], lora_id=3, lora_name="sql"))
    assert out == [BlockStored(block_hashes=compute_block_hashes(TOKENS[:BS], BS, lora_name="sql"),
                               lora_name="sql")]
    assert out[0].block_hashes != compute_block_hashes(TOKENS[:BS], BS)
    assert translate(tr, stored_array([2], None, TOKENS[:BS], lora_id=4)) == []
    assert tr.stats.skipped_lora == 1


def test_only_the_first_full_attention_group_is_followed():
    tr = KvEventTranslator(BS)
    expected = compute_block_hashes(TOKENS[: 2 * BS], BS)
    # A sliding-window group's blocks leave the cache early: never indexed.
    assert translate(tr, stored_map([1], None, TOKENS[:BS], group_idx=0,
                                    kv_cache_spec_kind="sliding_window")) == []
    out = translate(tr, stored_map([1, 2], None, TOKENS[: 2 * BS], group_idx=1,
                                   kv_cache_spec_kind="full_attention"))
    assert out == [BlockStored(block_hashes=expected)]
    # The same vLLM hash evicted from group 0 must not remove group 1's block.
    assert translate(tr, removed_map([2], group_idx=0)) == []
    assert translate(tr, removed_map([2], group_idx=1)) == [BlockRemoved(block_hashes=[expected[1]])]
    assert tr.stats.skipped_group == 2


def test_blocks_skipped_inside_the_range_only_extend_the_chain():
    # token_ids cover 3 blocks but vLLM sends 1 hash (it skipped 2 already-cached blocks in the range).
    tr = KvEventTranslator(BS)
    expected = compute_block_hashes(TOKENS[: 3 * BS], BS)
    out = translate(tr, stored_array([3], None, TOKENS[: 3 * BS]))
    assert out == [BlockStored(parent_block_hash=expected[1], block_hashes=[expected[2]])]
    # Fewer tokens than the hashes need, or a partial block: malformed, skipped.
    assert translate(tr, stored_array([4, 5], 3, TOKENS[3 * BS: 4 * BS])) == []
    assert translate(tr, stored_array([4], 3, TOKENS[3 * BS: 4 * BS - 1])) == []
    assert tr.stats.malformed == 2


def test_router_index_matches_prompts_from_translated_events_and_dump():
    """End to end with kvflow's KV index: translated vLLM events make prompt hashes match."""
    tr = KvEventTranslator(BS)
    stream = [
        [stored_map([1, 2, 3], None, TOKENS[: 3 * BS])],
        [stored_map([4, 5], 3, TOKENS[3 * BS: 5 * BS]), stored_map([1, 2], None, [], medium="CPU")],
        [removed_map([5])],
    ]
    index = KvIndex(BS)
    for event_id, events in enumerate(stream):
        kv_events = tr.translate_payload(batch_array(events))
        index.apply(KvEventBatch(worker_id="w0", event_id=event_id, block_size=BS, ts_ms=0, events=kv_events))
    prompt_hashes = compute_block_hashes(TOKENS, BS)
    scores = index.find_matches(prompt_hashes)
    assert scores.prefix("w0") == 4 and scores.device["w0"] == 4
    # The dump rebuilds the same view in a fresh index (a router resync).
    dump = tr.dump()
    assert all(isinstance(e, BlockStored) for e in dump)
    fresh = KvIndex(BS)
    fresh.apply(KvEventBatch(worker_id="w0", event_id=0, block_size=BS, ts_ms=0, events=dump, dump=True))
    assert fresh.find_matches(prompt_hashes).prefix("w0") == 4
    assert fresh.num_blocks("w0", KvTier.host) == 2 and fresh.num_blocks("w0", KvTier.device) == 4


@pytest.mark.skipif(not HAS_MSGSPEC, reason="msgspec (installed with vllm) is not installed")
@pytest.mark.parametrize("array_like_events,array_like_batch", [(True, True), (False, True), (False, False)])
def test_payloads_encoded_by_msgspec_structs_decode(array_like_events, array_like_batch):
    """Encode with msgspec structs declared like vLLM's (same options, same field order)."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=array_like_batch, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like_events, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStoredV(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemovedV(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksClearedV(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    batch = EventBatch(ts=2.0, data_parallel_rank=0, events=[
        BlockStoredV([2**64 - 1, 5], None, TOKENS[: 2 * BS], BS, None, "GPU", None, extra_keys=[None, None],
                     group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemovedV([5], "GPU", group_idx=0),
        AllBlocksClearedV(),
    ])
    payload = msgspec.msgpack.Encoder().encode(batch)
    tr = KvEventTranslator(BS)
    expected = compute_block_hashes(TOKENS[: 2 * BS], BS)
    assert tr.translate_payload(payload) == [
        BlockStored(block_hashes=expected), BlockRemoved(block_hashes=[expected[1]]), AllBlocksCleared()]


# ---- the subscriber -----------------------------------------------------------------


def frames(seq: int, payload: bytes, topic: bytes = b"kvflow") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def test_subscriber_orders_batches_and_counts_duplicates_gaps_and_garbage():
    received: list = []
    sub = VllmKvEventSubscriber("ipc:///unused", KvEventTranslator(BS), received.append, topic="kvflow")
    expected = compute_block_hashes(TOKENS[: 2 * BS], BS)
    assert sub.handle_frames(frames(0, batch_array([stored_array([1], None, TOKENS[:BS])]))) == [
        BlockStored(block_hashes=[expected[0]])]
    assert sub.handle_frames(frames(0, batch_array([removed_array([1])]))) == []  # duplicate seq: dropped
    assert sub.handle_frames(frames(2, batch_array([stored_array([2], 1, TOKENS[BS: 2 * BS])]))) == [
        BlockStored(parent_block_hash=expected[0], block_hashes=[expected[1]])]  # gap: applied, counted
    assert sub.handle_frames(frames(3, b"\xc1")) == []
    assert sub.handle_frames([b"kvflow", b"\x00"]) == []
    assert sub.handle_frames(frames(4, batch_array([]))) == []  # empty batch: nothing sent to the sink
    stats = sub.stats
    assert (stats.messages, stats.batches, stats.duplicates, stats.gaps, stats.decode_errors, stats.bad_frames) == (
        6, 3, 1, 1, 1, 1)
    assert stats.last_seq == 4 and stats.events_emitted == 2 and len(received) == 2


@pytest.mark.skipif(not HAS_ZMQ, reason="pyzmq (installed with vllm) is not installed")
async def test_zmq_pub_sub_round_trip_over_ipc():
    """A real PUB socket bound like vLLM's publisher (ipc:// binds) → the subscriber → the sink."""
    import zmq

    endpoint = new_ipc_endpoint("kvflow-test")
    received: list = []
    translator = KvEventTranslator(BS)
    sub = VllmKvEventSubscriber(endpoint, translator, received.extend, topic="kvflow")
    await sub.start()  # connects before the publisher binds, as the engine does
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    expected = compute_block_hashes(TOKENS[: 2 * BS], BS)
    try:
        # The subscription travels asynchronously ("slow joiner"): repeat batch 0 until it lands;
        # the repeats are dropped as duplicates.
        first = batch_array([stored_array([1, 2], None, TOKENS[: 2 * BS])])
        for _ in range(200):
            pub.send_multipart(frames(0, first))
            pub.send_multipart(frames(0, first, topic=b"other"))  # another topic: filtered by ZeroMQ
            await asyncio.sleep(0.02)
            if sub.stats.batches:
                break
        assert sub.stats.batches == 1, "no batch arrived over ZeroMQ"
        pub.send_multipart(frames(1, batch_map([removed_map([2])])))
        for _ in range(200):
            if sub.stats.last_seq == 1:
                break
            await asyncio.sleep(0.01)
        assert received == [BlockStored(block_hashes=expected), BlockRemoved(block_hashes=[expected[1]])]
        assert sub.stats.gaps == 0 and sub.stats.batches == 2
        assert sub.running
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint.removeprefix("ipc://"))  # ZeroMQ leaves the bound socket file behind
    assert not sub.running
