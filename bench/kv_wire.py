"""Wire formats for the kv-events topic, measured: encode, decode, decode + apply.

The events are those of ``bench/kv_index.py`` (Mooncake conversation trace,
8 workers, LRU of ``--capacity`` blocks each): one batch per stored or
removed event, as a worker publishes them. Each candidate encodes every
batch from the :class:`~kvflow.schemas.KvEventBatch` a worker holds, then
decodes it, then decodes it and applies its hashes to one compiled
``BlockMap`` per worker (``store``/``remove``, the index's hot path). Every
pass is timed as a whole; a candidate's figure is its fastest of
``--repeat`` passes, in µs per batch.

Candidates:

- ``json_pydantic``: the version-1 form (pydantic ``model_dump_json`` /
  ``model_validate_json``), hashes applied as lists of ints;
- ``msgspec_json``, ``msgspec_msgpack``: msgspec Structs of the same shape
  (hashes ``list[int]`` with ``ge=0``, validated while decoding);
- ``msgpack_lists``: the ``msgpack`` package, plain dicts and lists, no
  validation (a lower bound for msgpack with int lists);
- ``struct_fixed_width``: a hand-rolled layout (``struct`` headers, then
  each event's hashes as u64 little-endian), decoded with the version,
  flag, bounds and UTF-8 checks a reader needs and applied as ``'Q'``
  memoryviews into the record;
- ``struct_fixed_width_numpy``: the same, hashes taken with ``numpy.frombuffer``;
- ``msgspec_msgpack_u64_bin``: the form kvflow uses (schema version 2 of
  :mod:`kvflow.schemas.kv_events`): a msgspec MessagePack map with a version
  ``v`` whose events carry their hashes as one bin of u64 little-endian,
  decoded by :func:`~kvflow.schemas.decode_kv_frame` (zero-copy memoryviews);
- ``msgspec_msgpack_u64_bin_tolist``: the same, hashes converted to lists of
  ints before applying (what a map that only takes ints would need).

The process is pinned to one CPU (``--cpu``, default 0; ``--no-pin`` to
leave it free).

    python bench/kv_wire.py [--limit N] [--repeat 5] [--cpu 0 | --no-pin]

Last stdout line: one JSON object with the figures.
"""

import argparse
import gc
import json
import os
import struct
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_index import build_workload, default_trace  # noqa: E402


def make_batches(ops: list[tuple], block_size: int) -> list:
    """One :class:`~kvflow.schemas.KvEventBatch` per stored/removed op, per-worker event ids from 0."""
    from kvflow.schemas import BlockRemoved, BlockStored, KvEventBatch

    out = []
    next_id: dict[int, int] = {}
    for op in ops:
        if op[0] == "q":
            continue
        w = op[1]
        eid = next_id.get(w, 0)
        next_id[w] = eid + 1
        ev = (BlockStored(parent_block_hash=op[2], block_hashes=op[3]) if op[0] == "s"
              else BlockRemoved(block_hashes=op[2]))
        out.append(KvEventBatch(worker_id=f"worker-{w}", event_id=eid, block_size=block_size, ts_ms=0, events=[ev]))
    return out


Codec = tuple[Callable, Callable, Callable]  # (encode batch -> bytes, decode bytes -> obj, apply(obj, maps))

# The hand-rolled layout measured as ``struct_fixed_width`` (little-endian):
# header  u8 magic 0xC1, u8 version, u8 flags (bit 0 dump), u16 worker id
#         bytes W, u32 block_size, u64 event_id, i64 ts_ms, u32 events E;
#         W bytes worker id;
# event   u8 kind (0 stored, 1 removed, 2 cleared), u8 tier, u8 flags (bit 0
#         parent follows), u16 LoRA bytes L, u32 hashes N; [u64 parent];
#         L bytes LoRA; N x u64 hashes.
_SHEADER = struct.Struct("<BBBHIQqI")
_SEVENT = struct.Struct("<BBBHI")
_SU64 = struct.Struct("<Q")


def struct_encode(batch) -> bytes:
    """``batch`` in the hand-rolled layout above."""
    from kvflow.schemas import BlockStored

    wid = batch.worker_id.encode()
    parts = [_SHEADER.pack(0xC1, 2, int(batch.dump), len(wid), batch.block_size, batch.event_id, batch.ts_ms,
                           len(batch.events)), wid]
    for ev in batch.events:
        stored = type(ev) is BlockStored
        parent = ev.parent_block_hash if stored else None
        parts.append(_SEVENT.pack(0 if stored else 1, 0, parent is not None, 0, len(ev.block_hashes)))
        if parent is not None:
            parts.append(_SU64.pack(parent))
        parts.append(array("Q", ev.block_hashes).tobytes())
    return b"".join(parts)


def struct_decode(data: bytes, hashes_of: Callable | None = None):
    """The hand-rolled layout, with the checks a reader must make (magic, version, flags, bounds, UTF-8).

    ``hashes_of(data, offset, n)`` makes the hashes; default a ``'Q'`` memoryview slice.
    """
    size = len(data)
    if size < 29 or data[0] != 0xC1:
        raise ValueError("not a record")
    _, version, flags, wlen, block_size, event_id, ts_ms, n_events = _SHEADER.unpack_from(data)
    off = 29 + wlen
    if version != 2 or flags > 1 or not block_size or off > size:
        raise ValueError("bad header")
    worker_id = str(data[29:off], "utf-8")
    view = memoryview(data)
    events = []
    for _ in range(n_events):
        if off + 9 > size:
            raise ValueError("truncated")
        kind, tier, eflags, llen, n = _SEVENT.unpack_from(data, off)
        off += 9
        if kind > 2 or tier > 2 or eflags > 1 or (kind and (eflags or llen)):
            raise ValueError("bad event")
        parent = lora = None
        if eflags:
            parent = _SU64.unpack_from(data, off)[0]
            off += 8
        if llen:
            lora = str(data[off:off + llen], "utf-8")
            off += llen
        end = off + 8 * n
        if end > size:
            raise ValueError("truncated")
        events.append((kind, tier, hashes_of(data, off, n) if hashes_of else view[off:end].cast("Q"), parent, lora))
        off = end
    if off != size:
        raise ValueError("trailing bytes")
    return _Frame(worker_id, events)


def codecs() -> dict[str, Codec]:
    """Every candidate: ``name -> (encode, decode, decode_and_apply)``.

    (No ``from __future__ import annotations`` in this file: msgspec resolves
    the local Structs' annotations at class creation.)
    """
    import msgpack
    import msgspec
    import numpy as np

    from kvflow.schemas import BlockStored, KvEventBatch, decode_kv_frame, encode_kv_batch
    from kvflow.schemas.kv_events import KvWireStored

    U64 = msgspec.Meta(ge=0)

    class MStored(msgspec.Struct, tag="stored", omit_defaults=True):
        block_hashes: list[Annotated[int, U64]]
        parent_block_hash: Annotated[int, U64] | None = None
        tier: str = "device"
        lora_name: str | None = None

    class MRemoved(msgspec.Struct, tag="removed", omit_defaults=True):
        block_hashes: list[Annotated[int, U64]]
        tier: str = "device"

    class MBatch(msgspec.Struct, omit_defaults=True):
        worker_id: str
        event_id: Annotated[int, U64]
        block_size: Annotated[int, msgspec.Meta(ge=1)]
        ts_ms: int
        events: list[MStored | MRemoved]
        dump: bool = False

    def to_m(b: KvEventBatch) -> MBatch:
        return MBatch(b.worker_id, b.event_id, b.block_size, b.ts_ms,
                      [MStored(e.block_hashes, e.parent_block_hash) if type(e) is BlockStored
                       else MRemoved(e.block_hashes) for e in b.events], b.dump)

    mj_enc, mj_dec = msgspec.json.Encoder(), msgspec.json.Decoder(MBatch)
    mp_enc, mp_dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(MBatch)

    def apply_structs(obj, maps):  # events with .block_hashes lists and a type tag
        m = maps[obj.worker_id]
        for ev in obj.events:
            if type(ev) in (MStored, BlockStored):
                m.store(0, ev.block_hashes)
            else:
                m.remove(0, ev.block_hashes)

    def apply_dicts(obj, maps):
        m = maps[obj["worker_id"]]
        for ev in obj["events"]:
            if ev["type"] == "stored":
                m.store(0, ev["block_hashes"])
            else:
                m.remove(0, ev["block_hashes"])

    def apply_frame(frame, maps):  # (kind, tier, 'Q' hashes, parent, lora) tuples of struct_decode
        m = maps[frame.worker_id]
        for kind, _tier, hashes, _parent, _lora in frame.events:
            if kind == 0:
                m.store(0, hashes)
            else:
                m.remove(0, hashes)

    def apply_wire(wire, maps):  # a KvWireBatch, as KvIndex applies it
        m = maps[wire.worker_id]
        for ev in wire.events:
            if type(ev) is KvWireStored:
                m.store(0, ev.block_hashes.cast("Q"))
            else:
                m.remove(0, ev.block_hashes.cast("Q"))

    def apply_wire_tolist(wire, maps):
        m = maps[wire.worker_id]
        for ev in wire.events:
            if type(ev) is KvWireStored:
                m.store(0, ev.block_hashes.cast("Q").tolist())
            else:
                m.remove(0, ev.block_hashes.cast("Q").tolist())

    def numpy_hashes(data: bytes, off: int, n: int):
        return np.frombuffer(data, "<u8", n, off)

    def msgpack_enc(b: KvEventBatch) -> bytes:
        return msgpack.packb(b.model_dump(mode="json", exclude_none=True))

    return {
        "json_pydantic": (lambda b: b.model_dump_json(exclude_none=True).encode(),
                          KvEventBatch.model_validate_json, apply_structs),
        "msgspec_json": (lambda b: mj_enc.encode(to_m(b)), mj_dec.decode, apply_structs),
        "msgspec_msgpack": (lambda b: mp_enc.encode(to_m(b)), mp_dec.decode, apply_structs),
        "msgpack_lists": (msgpack_enc, msgpack.unpackb, apply_dicts),
        "struct_fixed_width": (struct_encode, struct_decode, apply_frame),
        "struct_fixed_width_numpy": (struct_encode, lambda d: struct_decode(d, numpy_hashes), apply_frame),
        "msgspec_msgpack_u64_bin": (encode_kv_batch, decode_kv_frame, apply_wire),
        "msgspec_msgpack_u64_bin_tolist": (encode_kv_batch, decode_kv_frame, apply_wire_tolist),
    }


class _Frame:
    """What :func:`struct_decode` returns: a worker id and ``(kind, tier, hashes, parent, lora)`` tuples."""

    __slots__ = ("events", "worker_id")

    def __init__(self, worker_id: str, events: list) -> None:
        self.worker_id = worker_id
        self.events = events


def measure(batches: list, repeat: int) -> dict:
    """Per candidate: bytes per batch and the fastest pass of encode, decode, decode + apply (µs per batch)."""
    from kvflow.router._blockmap import BlockMap

    workers = sorted({b.worker_id for b in batches})
    out: dict = {}
    pc = time.perf_counter
    for name, (enc, dec, apply) in codecs().items():
        wire = [enc(b) for b in batches]
        best = {"encode": float("inf"), "decode": float("inf"), "decode_apply": float("inf")}
        gc.collect()
        for _ in range(repeat):
            t0 = pc()
            for b in batches:
                enc(b)
            best["encode"] = min(best["encode"], pc() - t0)
            t0 = pc()
            for data in wire:
                dec(data)
            best["decode"] = min(best["decode"], pc() - t0)
            maps = {w: BlockMap() for w in workers}
            t0 = pc()
            for data in wire:
                apply(dec(data), maps)
            best["decode_apply"] = min(best["decode_apply"], pc() - t0)
        n = len(batches)
        out[name] = {"bytes_per_batch": round(sum(map(len, wire)) / n, 1),
                     **{f"{k}_us": round(v / n * 1e6, 2) for k, v in best.items()}}
        print(f"{name}: {out[name]}", file=sys.stderr)
    return out


def main() -> None:
    """Parse arguments, pin, build the batches, measure every candidate, print the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=0, help="CPU to pin this process to")
    ap.add_argument("--no-pin", action="store_true", help="do not pin")
    args = ap.parse_args()
    if not args.no_pin:
        os.sched_setaffinity(0, {args.cpu})
    trace = args.trace or default_trace()
    wl = build_workload(trace, args.workers, args.capacity, args.block_size, args.limit)
    batches = make_batches(wl["ops"], args.block_size)
    hashes = sum(len(ev.block_hashes) for b in batches for ev in b.events)
    result = {"bench": "kv_wire", "trace": trace.name, "batches": len(batches),
              "hashes_per_batch": round(hashes / len(batches), 1), "repeat": args.repeat,
              "pinned_cpu": None if args.no_pin else args.cpu, "formats": measure(batches, args.repeat)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
