"""The binary kv-events wire form (schema version 2): round trips, the JSON
version-1 upcast, rejection of malformed records, and the index fed from it."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvflow.router import _blockmap_py
from kvflow.router.index import KvIndex
from kvflow.schemas import (
    KV_WIRE_VERSION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DeadLetter,
    KvEventBatch,
    KvTier,
    KvWireBatch,
    RecordError,
    decode,
    decode_kv_frame,
    encode,
)
from kvflow.schemas.kv_events import KvWireCleared, KvWireRemoved, KvWireStored

TOP = 2**64 - 1


def batch(events, *, worker="w0", event_id=0, block_size=16, dump=False, ts_ms=1_700_000_000_000) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, event_id=event_id, block_size=block_size, ts_ms=ts_ms, events=events,
                        dump=dump)


ROUND_TRIPS = {
    "largest_hashes": batch([BlockStored(parent_block_hash=TOP, block_hashes=[TOP, 0, TOP - 1, 2**63])]),
    "empty_batch": batch([]),
    "empty_hash_lists": batch([BlockStored(block_hashes=[]), BlockRemoved(block_hashes=[])]),
    "every_kind_and_tier": batch([
        BlockStored(parent_block_hash=5, block_hashes=[6, 7], tier=KvTier.host, lora_name="adapter-é"),
        BlockRemoved(block_hashes=[6], tier=KvTier.disk),
        AllBlocksCleared(),
        BlockStored(block_hashes=list(range(1000))),
    ], worker="wörker-☃", event_id=TOP, block_size=2**40, dump=True, ts_ms=-5),
    "empty_dump": batch([], event_id=9, dump=True),
}


@pytest.mark.parametrize("record", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_binary_round_trip(record):
    wire = encode(record)
    assert wire[0] in (*range(0x80, 0x90), 0xDE, 0xDF)  # a MessagePack map, never JSON
    assert decode(KvEventBatch, wire) == record
    assert KvEventBatch.from_wire(wire) == record
    frame = decode_kv_frame(wire)
    assert isinstance(frame, KvWireBatch) and frame.v == KV_WIRE_VERSION
    assert frame.to_batch() == record
    for ev, want in zip(frame.events, record.events):
        if not isinstance(want, AllBlocksCleared):
            assert ev.block_hashes.cast("Q").tolist() == want.block_hashes


def test_hashes_are_fixed_width_views_of_the_record():
    hashes = [TOP, 1, 2**32]
    wire = encode(batch([BlockStored(block_hashes=hashes)]))
    [ev] = decode_kv_frame(wire).events
    assert ev.block_hashes.obj is wire  # zero-copy: the record's own bytes
    assert ev.block_hashes.nbytes == 8 * len(hashes)
    assert (TOP).to_bytes(8, "little") + (1).to_bytes(8, "little") in wire  # u64 little-endian, in order


def test_binary_is_smaller_than_json():
    record = batch([BlockStored(block_hashes=[random.Random(0).randrange(2**64) for _ in range(200)])])
    assert len(encode(record)) < 0.5 * len(record.model_dump_json(exclude_none=True))


def json_v1(record: KvEventBatch) -> bytes:
    """The version-1 wire form as workers published it before: pydantic JSON, schema_version 1."""
    return record.model_copy(update={"schema_version": 1}).model_dump_json(exclude_none=True).encode()


@pytest.mark.parametrize("record", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_json_v1_records_are_upcast(record):
    old = json_v1(record)
    assert b'"schema_version":1' in old
    got = decode(KvEventBatch, old)
    assert got == record and got.schema_version == KvEventBatch.SCHEMA_VERSION == 2
    assert decode(KvEventBatch, old.decode()) == record  # str values too
    assert decode_kv_frame(old).to_batch() == record
    assert decode_kv_frame(b"  \n" + old).to_batch() == record  # leading JSON whitespace


def test_index_fed_v1_json_and_v2_binary_agree():
    a, b, c = KvIndex(16), KvIndex(16), KvIndex(16)
    records = [batch([BlockStored(block_hashes=[1, 2, 3])], event_id=0),
               batch([BlockRemoved(block_hashes=[3]), BlockStored(parent_block_hash=2, block_hashes=[TOP])],
                     event_id=1)]
    for r in records:
        a.apply(r)
        b.apply(decode_kv_frame(json_v1(r)))
        c.apply(decode_kv_frame(encode(r)))
    assert a == b == c
    assert c.held("w0") == {1, 2, TOP}


def wire(**over) -> bytes:
    """A binary record built field by field, to make malformed ones."""
    fields = {"v": KV_WIRE_VERSION, "worker_id": "w0", "event_id": 0, "block_size": 16, "ts_ms": 1,
              "events": [{"type": "stored", "block_hashes": (7).to_bytes(8, "little")}]}
    fields.update(over)
    return msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not ...})


GOOD = encode(batch([BlockStored(parent_block_hash=1, block_hashes=[2, 3, TOP]), BlockRemoved(block_hashes=[9])]))

MALFORMED = {
    "empty": b"",
    "garbage": bytes(range(256)),
    "random_bytes": random.Random(1).randbytes(300),
    "not_json": b"{not json",
    "json_not_a_batch": b'{"worker_id": 5}',
    "json_negative_hash": json_v1(batch([BlockStored(block_hashes=[1])])).replace(b"[1]", b"[-1]"),
    "json_hash_too_big": json_v1(batch([BlockStored(block_hashes=[1])])).replace(b"[1]", str([2**64]).encode()),
    "msgpack_not_a_map_of_a_batch": msgspec.msgpack.encode({"a": 1}),
    "version_3": wire(v=3),
    "version_1_binary": wire(v=1),
    "no_version": wire(v=...),
    "truncated_record": GOOD[:-5],
    "truncated_header": GOOD[:3],
    "trailing_bytes": GOOD + b"\x00",
    "hash_array_not_whole_u64s": wire(events=[{"type": "stored", "block_hashes": b"\x01" * 12}]),
    "hash_array_one_byte_short": wire(events=[{"type": "removed", "block_hashes": b"\x01" * 15}]),
    "hashes_as_int_list": wire(events=[{"type": "stored", "block_hashes": [1, 2]}]),
    "unknown_event_type": wire(events=[{"type": "moved", "block_hashes": b""}]),
    "unknown_tier": wire(events=[{"type": "stored", "block_hashes": b"", "tier": "tape"}]),
    "negative_parent": wire(events=[{"type": "stored", "block_hashes": b"", "parent_block_hash": -1}]),
    "block_size_zero": wire(block_size=0),
    "negative_event_id": wire(event_id=-1),
    "event_id_a_string": wire(event_id="1"),
    "worker_id_missing": wire(worker_id=...),
    # msgpack str header 0xA2 and two bytes that are not UTF-8, in place of "w0"
    "worker_id_not_utf8": wire().replace(b"\xa2w0", b"\xa2\xff\xfe"),
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_records_raise_record_error(raw):
    with pytest.raises(RecordError):
        decode_kv_frame(raw)
    with pytest.raises(RecordError):
        decode(KvEventBatch, raw)


def test_the_well_formed_record_behind_the_malformed_ones_decodes():
    assert decode_kv_frame(wire()).events[0].block_hashes.cast("Q").tolist() == [7]
    assert decode_kv_frame(GOOD).to_batch() == decode(KvEventBatch, GOOD)


def test_wrong_version_says_so():
    with pytest.raises(RecordError, match="version 3"):
        decode_kv_frame(wire(v=3))


def test_encode_refuses_what_the_wire_cannot_carry():
    with pytest.raises(ValueError):
        encode(batch([], event_id=2**64))
    with pytest.raises(ValueError):
        encode(batch([], ts_ms=-(2**64)))


def random_batches(rng: random.Random, n: int) -> list[KvEventBatch]:
    universe = [rng.randrange(2**64) for _ in range(400)] + [0, TOP]
    next_id = {}
    out = []
    for _ in range(n):
        w = f"w{rng.randrange(5)}"
        events = []
        for _ in range(rng.randrange(0, 4)):
            r = rng.random()
            tier = rng.choice([KvTier.device] * 4 + [KvTier.host, KvTier.disk])
            hs = rng.sample(universe, rng.randrange(0, 60))
            if r < 0.55:
                events.append(BlockStored(block_hashes=hs, tier=tier, parent_block_hash=rng.choice([None, hs[0] if hs
                                                                                                    else None])))
            elif r < 0.95:
                events.append(BlockRemoved(block_hashes=hs, tier=tier))
            else:
                events.append(AllBlocksCleared())
        eid = next_id.get(w, 0) + (rng.random() < 0.05)  # the odd gap
        if rng.random() < 0.05:
            eid = max(0, eid - 2)  # the odd duplicate
        next_id[w] = eid + 1
        out.append(batch(events, worker=w, event_id=eid, dump=rng.random() < 0.03))
    return out


@pytest.mark.parametrize("block_map", ["default", "python"])
@pytest.mark.parametrize("seed", range(3))
def test_index_from_binary_frames_equals_index_from_models(seed, block_map):
    bm = _blockmap_py.BlockMap if block_map == "python" else None
    from_models, from_wire = KvIndex(16, block_map=bm), KvIndex(16, block_map=bm)
    for b in random_batches(random.Random(seed), 300):
        r1 = from_models.apply(b)
        r2 = from_wire.apply(decode_kv_frame(encode(b)))
        assert r1 == r2
    assert from_models == from_wire
    assert from_models.snapshot()["workers"]  # the comparison saw blocks


def test_wire_structs_are_the_declared_schema():
    ev = msgspec.msgpack.decode(GOOD)
    assert ev["v"] == KV_WIRE_VERSION and set(ev) == {"v", "worker_id", "event_id", "block_size", "ts_ms", "events"}
    assert [e["type"] for e in ev["events"]] == ["stored", "removed"]
    assert {KvWireStored.__struct_config__.tag, KvWireRemoved.__struct_config__.tag,
            KvWireCleared.__struct_config__.tag} == {"stored", "removed", "cleared"}


def test_a_dead_binary_record_keeps_its_bytes():
    raw = GOOD[:-5]
    letter = DeadLetter.of(source_topic="t", partition=0, offset=1, key=b"w0", value=raw, error="bad", consumer="c")
    assert decode(DeadLetter, encode(letter)).original_value() == raw


def test_every_truncation_is_refused():
    for n in range(len(GOOD)):
        with pytest.raises(RecordError):
            decode_kv_frame(GOOD[:n])


def test_corrupted_bytes_decode_or_raise_record_error_only():
    rng = random.Random(7)
    for _ in range(3000):
        raw = bytearray(GOOD)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            frame = decode_kv_frame(bytes(raw))
        except RecordError:
            continue
        frame.to_batch()  # whatever decodes is a valid record
