"""Records on the kv-events topic: what each worker's KV cache stored and evicted.

A worker publishes one :class:`KvEventBatch` per engine step that changed its
cache, keyed by worker id, with a per-worker monotonic ``event_id`` so that a
consumer can detect duplicates (id <= last seen) and gaps (id > last + 1).
Block hashes are the chained sequence hashes of :mod:`kvflow.schemas.block_hash`.

Wire format (schema version 2, binary). Unlike the other topics a batch is
not JSON: it is mostly u64 block hashes, and parsing them as 20-digit decimal
integers cost the router more than applying them to its index. A record is
one MessagePack map, :class:`KvWireBatch`, whose events carry their block
hashes as a single ``bytes`` value of fixed-width u64 little-endian
integers (8 bytes a hash, in order); every other field has the name, type
and meaning it has in :class:`KvEventBatch`, plus ``v``, the wire version
(:data:`KV_WIRE_VERSION`). Fields at their default are left out. So a reader
can hand the record's own bytes to the index (:func:`decode_kv_frame`
returns the :class:`KvWireBatch` itself, its hashes zero-copy memoryviews of
the record) with no int object per block, and the envelope is parsed and
type-checked by msgspec in C.
``bench/kv_wire.py`` measured this against msgpack/msgspec with int lists,
a hand-rolled struct layout and JSON (figures in ``docs/benchmarks.md``).

Schema version 1 was pydantic's JSON of :class:`KvEventBatch`; readers still
accept it. :func:`decode_kv_frame` and :meth:`KvEventBatch.from_wire` sniff the
first byte: a MessagePack map starts with 0x80-0x8F, 0xDE or 0xDF, which
JSON text never does; anything else is read as JSON and upcast (same fields,
same meaning; ``schema_version`` becomes 2).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from enum import Enum
from typing import Annotated, ClassVar, Literal, Union

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvflow.schemas.base import Record, RecordError

__all__ = [
    "KvTier", "BlockHash", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "KvEventBatch",
    "KvDumpRequest", "KvWireBatch", "KvWireStored", "KvWireRemoved", "KvWireCleared", "KV_WIRE_VERSION",
    "decode_kv_frame", "encode_kv_batch",
]


class KvTier(str, Enum):
    """Where a cached block lives: GPU/accelerator memory, host RAM, or disk."""

    device = "device"
    host = "host"
    disk = "disk"


BlockHash = Annotated[int, Field(ge=0, lt=2**64)]
"""A chained sequence block hash: XXH3-64, so an unsigned 64-bit int (:mod:`kvflow.schemas.block_hash`)."""


class BlockStored(BaseModel):
    """Blocks now cached, in sequence order, continuing from ``parent_block_hash``."""

    model_config = ConfigDict(frozen=True)
    type: Literal["stored"] = "stored"
    parent_block_hash: BlockHash | None = None
    block_hashes: list[BlockHash]
    tier: KvTier = KvTier.device
    lora_name: str | None = None


class BlockRemoved(BaseModel):
    """Blocks evicted from ``tier``."""

    model_config = ConfigDict(frozen=True)
    type: Literal["removed"] = "removed"
    block_hashes: list[BlockHash]
    tier: KvTier = KvTier.device


class AllBlocksCleared(BaseModel):
    """The worker dropped its whole cache (restart, reset)."""

    model_config = ConfigDict(frozen=True)
    type: Literal["cleared"] = "cleared"


KvEvent = Annotated[Union[BlockStored, BlockRemoved, AllBlocksCleared], Field(discriminator="type")]


class KvEventBatch(Record):
    """Ordered KV events of one worker. ``dump`` marks a full resync snapshot
    (consumers replace that worker's state with it).

    On the wire it is binary (see the module docstring): :func:`kvflow.schemas.encode`
    and :func:`kvflow.schemas.decode` call :meth:`to_wire` and :meth:`from_wire`.
    Bounds the binary form imposes: ``event_id`` and ``block_size`` < 2**64,
    ``ts_ms`` in [-2**63, 2**63) (MessagePack integers).
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    schema_version: int = 2
    worker_id: str
    event_id: int = Field(ge=0)
    block_size: int = Field(ge=1)
    ts_ms: int
    events: list[KvEvent]
    dump: bool = False

    def to_wire(self) -> bytes:
        """This batch in the binary wire format (:func:`encode_kv_batch`).

        Raises:
            ValueError: a field outside the binary form's bounds (class docstring).
        """
        return encode_kv_batch(self)

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview | str | None) -> KvEventBatch:
        """Parse a kv-events record, binary (version 2) or JSON (version 1, upcast).

        Raises:
            RecordError: as :func:`decode_kv_frame`.
        """
        if isinstance(data, str):
            data = data.encode()
        if data and data[0] not in _MSGPACK_MAP:
            return _decode_json(data)
        return decode_kv_frame(data).to_batch()


class KvDumpRequest(Record):
    """Asks ``worker_id`` to publish a full dump of its cached blocks."""

    worker_id: str
    requested_by: str
    ts_ms: int


# ---- binary wire format (schema version 2; see the module docstring) ----

KV_WIRE_VERSION = 2
"""The ``v`` of a binary record. Version 1 is the JSON form, which has no ``v``."""

_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec rejects ints above 2**64 - 1 itself
_MSGPACK_MAP = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # fixmap, map 16, map 32
_LITTLE = sys.byteorder == "little"


class KvWireStored(msgspec.Struct, tag="stored", tag_field="type", omit_defaults=True):
    """A :class:`BlockStored` on the wire.

    ``block_hashes`` is N x u64 little-endian (8N bytes), a MessagePack bin.
    Decoded, it is a zero-copy byte ``memoryview`` of the record (encoders
    may give ``bytes``); after :func:`decode_kv_frame`,
    ``block_hashes.cast("Q")`` is the N hashes in order, in native byte order.
    """

    block_hashes: memoryview
    parent_block_hash: _U64 | None = None
    tier: KvTier = KvTier.device
    lora_name: str | None = None


class KvWireRemoved(msgspec.Struct, tag="removed", tag_field="type", omit_defaults=True):
    """A :class:`BlockRemoved` on the wire; ``block_hashes`` as in :class:`KvWireStored`."""

    block_hashes: memoryview
    tier: KvTier = KvTier.device


class KvWireCleared(msgspec.Struct, tag="cleared", tag_field="type", omit_defaults=True):
    """An :class:`AllBlocksCleared` on the wire."""


class KvWireBatch(msgspec.Struct, omit_defaults=True):
    """A :class:`KvEventBatch` on the wire: one MessagePack map (module docstring).

    ``v`` is :data:`KV_WIRE_VERSION`; readers refuse any other. Unknown keys
    are ignored, so a producer may add optional fields without a new version.
    It is also what :func:`decode_kv_frame` returns, and what the router's
    index applies, events and all, without a pydantic object per event.
    """

    v: int
    worker_id: str
    event_id: _U64
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    ts_ms: int
    events: list[Union[KvWireStored, KvWireRemoved, KvWireCleared]]
    dump: bool = False

    def to_batch(self) -> KvEventBatch:
        """The same record as a validated :class:`KvEventBatch` (one pydantic object per event).

        Raises:
            RecordError: a field fails the model's validation.
        """
        events: list[KvEvent] = []
        try:
            for ev in self.events:
                kind = type(ev)
                if kind is KvWireStored:
                    events.append(BlockStored(parent_block_hash=ev.parent_block_hash,
                                              block_hashes=ev.block_hashes.cast("Q").tolist(), tier=ev.tier,
                                              lora_name=ev.lora_name))
                elif kind is KvWireRemoved:
                    events.append(BlockRemoved(block_hashes=ev.block_hashes.cast("Q").tolist(), tier=ev.tier))
                else:
                    events.append(AllBlocksCleared())
            return KvEventBatch(worker_id=self.worker_id, event_id=self.event_id, block_size=self.block_size,
                                ts_ms=self.ts_ms, events=events, dump=self.dump)
        except ValidationError as exc:
            raise RecordError(f"{exc.error_count()} validation error(s): {exc.errors(include_url=False)[:3]}") from exc


_wire_encoder = msgspec.msgpack.Encoder()
_wire_decoder = msgspec.msgpack.Decoder(KvWireBatch)


def encode_kv_batch(batch: KvEventBatch) -> bytes:
    """Serialize ``batch`` to its binary wire form (a :class:`KvWireBatch`).

    Each event's hashes become one ``bytes`` of u64 little-endian, packed in
    C (``array('Q')``).

    Raises:
        ValueError: a field outside MessagePack's integer range (see :class:`KvEventBatch`).
    """
    try:
        return _wire_encoder.encode(_wire_batch(batch, _u64_bytes))
    except OverflowError as exc:
        raise ValueError(f"KV event batch of {batch.worker_id!r} does not fit MessagePack integers: {exc}") from exc


def _u64_bytes(hashes: list[int]) -> bytes:
    """``hashes`` as consecutive u64 little-endian.

    Raises:
        ValueError: a hash outside [0, 2**64).
    """
    try:
        arr = array("Q", hashes)
    except OverflowError as exc:
        raise ValueError(f"block hash outside [0, 2**64): {exc}") from exc
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def decode_kv_frame(data: bytes | bytearray | memoryview | None) -> KvWireBatch:
    """Parse and validate one kv-events record into a :class:`KvWireBatch`.

    The router's hot path: msgspec parses and type-checks the record in C;
    each event's ``block_hashes`` stays a byte memoryview of ``data`` (which
    it keeps alive) whose ``.cast("Q")`` is the event's hashes, so no int
    object is made per block. Every check :class:`KvEventBatch` makes is made
    here, so a record that decodes is one the model accepts. A record that
    does not start like a MessagePack map is read as the version-1 JSON form
    through pydantic and repacked (slow; records from before).

    Raises:
        RecordError: empty; neither a valid binary nor a valid JSON batch;
            truncated or trailing bytes; a ``v`` other than
            :data:`KV_WIRE_VERSION`; a hash array whose length is not a
            multiple of 8; a field of the wrong type or out of range.
    """
    if not data:
        raise RecordError("empty record value")
    if data[0] not in _MSGPACK_MAP:
        return _wire_of(_decode_json(data))
    try:
        wire = _wire_decoder.decode(data)
    except (msgspec.DecodeError, ValueError) as exc:  # ValidationError; UnicodeDecodeError for a bad str
        raise RecordError(f"invalid binary kv-events record: {exc}") from None
    if wire.v != KV_WIRE_VERSION:
        raise RecordError(f"unknown kv-events wire version {wire.v} (this reader knows {KV_WIRE_VERSION})")
    for i, ev in enumerate(wire.events):
        if type(ev) is not KvWireCleared:
            if len(ev.block_hashes) & 7:
                raise RecordError(f"kv event {i} has a block hash array of {len(ev.block_hashes)} bytes, "
                                  f"not a multiple of 8")
            if not _LITTLE:  # pragma: no cover - big-endian hosts: native order for .cast("Q")
                arr = array("Q", ev.block_hashes.tobytes())
                arr.byteswap()
                ev.block_hashes = memoryview(arr).cast("B")
    return wire


def _decode_json(data: bytes | bytearray | memoryview) -> KvEventBatch:
    """A version-1 (JSON) record, upcast to the current schema version.

    Raises:
        RecordError: not JSON, or fails validation.
    """
    try:
        batch = KvEventBatch.model_validate_json(bytes(data) if isinstance(data, memoryview) else data)
    except ValidationError as exc:
        raise RecordError(f"{exc.error_count()} validation error(s): {exc.errors(include_url=False)[:3]}") from exc
    if batch.schema_version != KvEventBatch.SCHEMA_VERSION:
        batch = batch.model_copy(update={"schema_version": KvEventBatch.SCHEMA_VERSION})
    return batch


def _wire_of(batch: KvEventBatch) -> KvWireBatch:
    """A validated batch as the :class:`KvWireBatch` :func:`decode_kv_frame` returns."""
    return _wire_batch(batch, _native_view)


def _wire_batch(batch: KvEventBatch, pack: Callable[[list[int]], bytes | memoryview]) -> KvWireBatch:
    """``batch`` as a :class:`KvWireBatch`, each event's hashes turned into bytes by ``pack``.

    Raises:
        ValueError: an event that is not a KV event.
    """
    events: list[KvWireStored | KvWireRemoved | KvWireCleared] = []
    for ev in batch.events:
        kind = type(ev)
        if kind is BlockStored:
            events.append(KvWireStored(pack(ev.block_hashes), ev.parent_block_hash, ev.tier, ev.lora_name))
        elif kind is BlockRemoved:
            events.append(KvWireRemoved(pack(ev.block_hashes), ev.tier))
        elif kind is AllBlocksCleared:
            events.append(KvWireCleared())
        else:
            raise ValueError(f"not a KV event: {kind.__name__}")
    return KvWireBatch(KV_WIRE_VERSION, batch.worker_id, batch.event_id, batch.block_size, batch.ts_ms, events,
                       batch.dump)


def _native_view(hashes: list[int]) -> memoryview:
    """``hashes`` as a byte memoryview of native u64 (what ``.cast("Q")`` reads back)."""
    return memoryview(array("Q", hashes)).cast("B")
