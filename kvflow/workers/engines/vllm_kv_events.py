"""vLLM's KV cache events, decoded and translated into kvflow KV events.

vLLM publishes what its prefix cache stores and evicts on a ZeroMQ PUB
socket (``KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
endpoint=..., topic=...)``). This module reads that stream and turns it into
kvflow's :class:`~kvflow.schemas.BlockStored` / :class:`~kvflow.schemas.BlockRemoved`
/ :class:`~kvflow.schemas.AllBlocksCleared` events for
:meth:`kvflow.workers.engines.base.Engine.emit_kv_events`.

Wire format (checked against ``vllm/distributed/kv_events.py`` and
``vllm/v1/core/block_pool.py`` of vllm-project/vllm):

* Each ZeroMQ message has three frames: ``topic`` (UTF-8), ``seq`` (8-byte
  big-endian unsigned, one per batch, from 0) and ``payload``
  (``ZmqEventPublisher._publisher_thread``).
* ``payload`` is a msgpack-encoded ``KVEventBatch``: ``ts`` (float seconds),
  ``events``, ``data_parallel_rank`` (optional). Events are tagged msgspec
  structs; the tag (the class name) is ``BlockStored``, ``BlockRemoved`` or
  ``AllBlocksCleared``. Field order, which matters for the positional form:

  - ``BlockStored``: ``block_hashes, parent_block_hash, token_ids,
    block_size, lora_id, medium, lora_name, extra_keys, group_idx,
    kv_cache_spec_kind, kv_cache_spec_sliding_window``;
  - ``BlockRemoved``: ``block_hashes, medium, group_idx``.

* Three layouts exist in the wild, and all three decode here:
  1. vLLM up to mid 2026 (structs declared ``array_like=True``): the batch is
     ``[ts, events, dp_rank]`` and each event ``["BlockStored", field, ...]``;
  2. after vllm-project/vllm#42892 (``array_like`` dropped from the event
     structs): the batch stays positional, each event is a map
     ``{"type": "BlockStored", "block_hashes": ..., ...}``;
  3. sources where the batch struct is not ``array_like`` either: the batch
     is a map ``{"ts": ..., "events": [...], "data_parallel_rank": ...}``.

  An ``array_like`` struct is written with every declared field, but older
  releases declared fewer (e.g. no ``medium``), so missing trailing fields
  read as None; extra trailing fields from newer releases are ignored. In
  the map form ``omit_defaults=True`` drops defaulted keys; absent keys read
  as None.
* Block hashes (``ExternalBlockHash``) are ints in older versions and may be
  ``bytes`` in newer ones; they are used here only as opaque keys.
* ``BlockStored.token_ids`` are the tokens of the newly cached blocks only
  (``all_token_ids[num_cached_blocks * block_size : num_full_blocks *
  block_size]``), and ``parent_block_hash`` is vLLM's hash of the block just
  before them (None at the start of a sequence). ``medium`` is ``"GPU"`` for
  the device pool; KV offloading connectors use other names (``"CPU"``, ...).

Re-hashing: vLLM's block hashes (SHA-256 or builtin hash over its own
key) are not kvflow's. The router's KV index looks up hashes computed from
prompts with :func:`kvflow.schemas.block_hash.compute_block_hashes`, so
:class:`KvEventTranslator` recomputes every stored block's kvflow sequence
hash from the event's token ids, chained from the kvflow hash of the vLLM
parent, and remembers vLLM hash → kvflow hashes per worker so that
removals (which carry only vLLM hashes) and later parents translate.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.aio import cancel_and_wait
from kvflow.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvTier
from kvflow.schemas.block_hash import chain_sequence_hashes, compute_local_block_hashes

__all__ = [
    "KvEventTranslator",
    "SubscriberStats",
    "TranslatorStats",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "VllmEventBatch",
    "VllmEventDecodeError",
    "VllmHash",
    "VllmKvEventSubscriber",
    "decode_vllm_event_batch",
    "medium_to_tier",
    "new_ipc_endpoint",
]

log = logging.getLogger(__name__)

VllmHash = int | bytes
"""A vLLM block hash (``ExternalBlockHash``): an int, or bytes in newer versions."""

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_FULL_ATTENTION = "full_attention"


# ---- decoded vLLM events ---------------------------------------------------


@dataclass(frozen=True)
class VllmBlockStored:
    """vLLM cached ``len(block_hashes)`` full blocks continuing ``parent_block_hash``.

    ``token_ids`` has shape [num_new_blocks * block_size] (may be longer than
    ``len(block_hashes) * block_size`` when vLLM skipped already-cached
    blocks inside the range; see :class:`KvEventTranslator`).
    """

    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True)
class VllmBlockRemoved:
    """vLLM evicted one copy of each block in ``block_hashes`` from ``medium``."""

    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class VllmAllBlocksCleared:
    """vLLM reset its prefix cache."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


@dataclass(frozen=True)
class VllmEventBatch:
    """One decoded ``KVEventBatch``: events of one engine step, in order.

    ``ts`` is vLLM's wall-clock time in seconds; ``num_unknown_events``
    counts events with a tag this module does not know (skipped, so that a
    newer vLLM event type does not break the stream).
    """

    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None = None
    num_unknown_events: int = 0


class VllmEventDecodeError(ValueError):
    """A payload is not a vLLM ``KVEventBatch`` (bad msgpack or bad shape)."""


@functools.cache
def _msgpack_decode() -> Callable[[bytes], Any]:
    """The msgpack decoder: msgspec's (shipped with vLLM), else msgpack's.

    Both map msgpack arrays to lists, maps to dicts and bin to bytes.

    Raises:
        ImportError: neither package is installed.
    """
    try:
        import msgspec

        return msgspec.msgpack.decode
    except ImportError:
        pass
    try:
        import msgpack
    except ImportError as exc:
        raise ImportError("decoding vLLM KV events needs 'msgspec' (installed with vllm) or 'msgpack'") from exc
    return functools.partial(msgpack.unpackb, raw=False, strict_map_key=False)


def _unpackb(payload: bytes) -> Any:
    decode = _msgpack_decode()
    try:
        return decode(payload)
    except Exception as exc:  # msgspec.DecodeError, or msgpack's several exception types
        raise VllmEventDecodeError(f"not msgpack: {exc}") from exc


def _fields(obj: Any, names: Sequence[str], what: str) -> dict[str, Any]:
    """Field values of a positional (list) or named (dict) msgspec struct."""
    if isinstance(obj, dict):
        return {name: obj.get(name) for name in names}
    if isinstance(obj, (list, tuple)):
        if len(obj) > len(names):
            # A newer vLLM appended fields: keep the ones we know.
            obj = obj[: len(names)]
        return {name: (obj[i] if i < len(obj) else None) for i, name in enumerate(names)}
    raise VllmEventDecodeError(f"{what} is neither an array nor a map: {type(obj).__name__}")


def _hashes(value: Any, what: str) -> tuple[VllmHash, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, (int, bytes)) for h in value):
        raise VllmEventDecodeError(f"{what} must be a list of int or bytes hashes")
    return tuple(value)


def _opt_int(value: Any, what: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise VllmEventDecodeError(f"{what} must be an int or null")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise VllmEventDecodeError(f"{what} must be a string or null")
    return value


def _decode_event(raw: Any) -> VllmEvent | None:
    if isinstance(raw, dict):
        tag, body = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw:
        tag, body = raw[0], list(raw[1:])
    else:
        raise VllmEventDecodeError(f"event is neither a tagged array nor a tagged map: {raw!r:.80}")
    if tag == "BlockStored":
        f = _fields(body, _STORED_FIELDS, "BlockStored")
        tokens = f["token_ids"] if f["token_ids"] is not None else []
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) for t in tokens):
            raise VllmEventDecodeError("BlockStored.token_ids must be a list of ints")
        block_size = f["block_size"]
        if not isinstance(block_size, int) or block_size < 1:
            raise VllmEventDecodeError(f"BlockStored.block_size must be an int >= 1, got {block_size!r}")
        parent = f["parent_block_hash"]
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise VllmEventDecodeError("BlockStored.parent_block_hash must be int, bytes or null")
        return VllmBlockStored(
            block_hashes=_hashes(f["block_hashes"], "BlockStored.block_hashes"),
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_id=_opt_int(f["lora_id"], "BlockStored.lora_id"),
            medium=_opt_str(f["medium"], "BlockStored.medium"),
            lora_name=_opt_str(f["lora_name"], "BlockStored.lora_name"),
            group_idx=_opt_int(f["group_idx"], "BlockStored.group_idx"),
            kv_cache_spec_kind=_opt_str(f["kv_cache_spec_kind"], "BlockStored.kv_cache_spec_kind"),
        )
    if tag == "BlockRemoved":
        f = _fields(body, _REMOVED_FIELDS, "BlockRemoved")
        return VllmBlockRemoved(
            block_hashes=_hashes(f["block_hashes"], "BlockRemoved.block_hashes"),
            medium=_opt_str(f["medium"], "BlockRemoved.medium"),
            group_idx=_opt_int(f["group_idx"], "BlockRemoved.group_idx"),
        )
    if tag == "AllBlocksCleared":
        return VllmAllBlocksCleared()
    return None


def decode_vllm_event_batch(payload: bytes) -> VllmEventBatch:
    """Decode one msgpack ``KVEventBatch`` payload (any of the three layouts).

    Args:
        payload: the third frame of a vLLM KV event message.

    Returns:
        The batch; events with an unknown tag are skipped and counted in
        ``num_unknown_events``.

    Raises:
        VllmEventDecodeError: not msgpack, or not shaped like a ``KVEventBatch``.
    """
    f = _fields(_unpackb(payload), _BATCH_FIELDS, "KVEventBatch")
    ts, raw_events = f["ts"], f["events"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise VllmEventDecodeError(f"KVEventBatch.ts must be a number, got {ts!r:.40}")
    if not isinstance(raw_events, (list, tuple)):
        raise VllmEventDecodeError("KVEventBatch.events must be an array")
    events: list[VllmEvent] = []
    unknown = 0
    for raw in raw_events:
        event = _decode_event(raw)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return VllmEventBatch(ts=float(ts), events=tuple(events),
                          data_parallel_rank=_opt_int(f["data_parallel_rank"], "KVEventBatch.data_parallel_rank"),
                          num_unknown_events=unknown)


_MEDIUM_TIERS = {
    # vLLM's device pool is "GPU" (MEDIUM_GPU); other accelerators' names map alike.
    "gpu": KvTier.device, "cuda": KvTier.device, "xpu": KvTier.device, "hpu": KvTier.device,
    "npu": KvTier.device, "tpu": KvTier.device, "device": KvTier.device,
    # Host RAM tiers of KV offloading connectors.
    "cpu": KvTier.host, "cpu_pinned": KvTier.host, "host": KvTier.host, "dram": KvTier.host,
    # Storage tiers.
    "disk": KvTier.disk, "localdisk": KvTier.disk, "local_disk": KvTier.disk, "ssd": KvTier.disk,
    "nvme": KvTier.disk, "file": KvTier.disk,
}


def medium_to_tier(medium: str | None) -> KvTier | None:
    """The kvflow tier of a vLLM ``medium`` string (case-insensitive).

    ``None`` (vLLM versions before the field existed, where every event was
    the GPU pool) maps to :attr:`KvTier.device`; ``"GPU"`` and other
    accelerator names to ``device``; ``"CPU"``/``"CPU_PINNED"`` to ``host``;
    ``"DISK"``/``"LocalDisk"``/``"SSD"``/``"NVMe"`` to ``disk``. Returns None
    for anything else (the caller skips such events).
    """
    if medium is None:
        return KvTier.device
    return _MEDIUM_TIERS.get(medium.strip().lower())


# ---- translation -----------------------------------------------------------


@dataclass
class TranslatorStats:
    """Counts kept by :class:`KvEventTranslator` (all cumulative).

    ``stored_blocks`` / ``removed_blocks`` count vLLM blocks accepted;
    the ``skipped_*`` and ``unknown_*`` fields count what was dropped and why.
    """

    batches: int = 0
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    unknown_removed: int = 0
    """Removed hashes never stored (or already removed) in that tier: ignored."""
    unknown_parent: int = 0
    """Stored events whose parent hash is unknown: the chain cannot be rebuilt, so skipped."""
    unknown_untokenized: int = 0
    """Stored blocks with no token ids and a hash not seen before: skipped."""
    skipped_group: int = 0
    """Events of another KV cache group, or of a non full-attention group."""
    skipped_medium: int = 0
    skipped_block_size: int = 0
    """Stored events whose block size is not a multiple of kvflow's."""
    skipped_lora: int = 0
    """Stored events with a LoRA id but no LoRA name (the name salts kvflow hashes)."""
    malformed: int = 0
    """Stored events whose token count does not cover their blocks."""
    unknown_event_types: int = 0


@dataclass
class _Entry:
    """What kvflow knows of one vLLM block hash on this worker."""

    kv_hashes: tuple[int, ...]  # kvflow sequence hashes of the kvflow blocks it spans
    parent: int | None  # kvflow hash just before kv_hashes[0]
    lora_name: str | None
    copies: Counter = field(default_factory=Counter)  # KvTier -> physical copies held


class KvEventTranslator:
    """Turns one worker's vLLM KV events into kvflow KV events (pure, no I/O).

    Args:
        block_size: kvflow's block size in tokens (the worker's
            ``Engine.block_size``). A vLLM block of ``block_size * k``
            tokens becomes ``k`` kvflow blocks; other sizes are skipped.

    State, per worker:

    * vLLM hash → kvflow hashes (plus the kvflow parent and per-tier copy
      counts), to translate removals and later parents;
    * a per-tier count of copies of each kvflow hash. vLLM does not
      de-duplicate its cache (two physical blocks may share a hash), and two
      vLLM hashes may name the same tokens (vLLM also hashes extra keys such
      as a cache salt), so a kvflow ``BlockRemoved`` is emitted only when
      the last copy in that tier goes.

    Rules:

    * Stored: kvflow hashes are recomputed from ``token_ids`` with
      :func:`~kvflow.schemas.block_hash.compute_local_block_hashes` (salted by
      ``lora_name``) and chained from the kvflow hash of the vLLM parent.
      Unknown parent → skipped (``unknown_parent``). If ``token_ids`` covers
      more blocks than ``block_hashes`` (vLLM skipped blocks already cached
      inside the range), the hashes are taken to be the trailing blocks, the
      leading ones only extend the chain. An event without token ids (a copy
      into another tier) reuses the known mapping of each hash.
    * Removed: each hash drops one copy in its tier; unknown hashes are
      ignored and counted (``unknown_removed``).
    * Cleared: forget everything, emit :class:`~kvflow.schemas.AllBlocksCleared`.
    * Groups: only one KV cache group is followed, the first full-attention
      group seen (``group_idx`` None counts as 0); events of other groups
      (e.g. sliding-window layers, whose blocks leave early) are skipped.
    * Multimodal ``extra_keys`` are not folded into kvflow hashes (kvflow
      engines serve text prompts).
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.stats = TranslatorStats()
        self._entries: dict[VllmHash, _Entry] = {}  # insertion order: parents before children
        self._held: Counter = Counter()  # (KvTier, kvflow hash) -> copies
        self._group: int | None = None

    def __len__(self) -> int:
        """Number of vLLM blocks currently known (any tier)."""
        return len(self._entries)

    def kvflow_hashes(self, vllm_hash: VllmHash) -> tuple[int, ...] | None:
        """The kvflow hashes a known vLLM block hash maps to, else None."""
        entry = self._entries.get(vllm_hash)
        return entry.kv_hashes if entry is not None else None

    def num_held(self, tier: KvTier = KvTier.device) -> int:
        """Distinct kvflow block hashes held in ``tier``."""
        return sum(1 for t, _ in self._held if t == tier)

    # ---- entry points -----------------------------------------------------

    def translate_payload(self, payload: bytes) -> list[KvEvent]:
        """Decode one ``KVEventBatch`` payload and translate it.

        Raises:
            VllmEventDecodeError: the payload does not decode.
        """
        return self.translate(decode_vllm_event_batch(payload))

    def translate(self, batch: VllmEventBatch) -> list[KvEvent]:
        """kvflow events for one vLLM batch, in order (possibly empty)."""
        self.stats.batches += 1
        self.stats.unknown_event_types += batch.num_unknown_events
        out: list[KvEvent] = []
        for event in batch.events:
            self.stats.events += 1
            translated: KvEvent | None
            if isinstance(event, VllmBlockStored):
                translated = self._stored(event)
            elif isinstance(event, VllmBlockRemoved):
                translated = self._removed(event)
            else:
                translated = self._cleared()
            if translated is not None:
                out.append(translated)
        return out

    def dump(self) -> list[KvEvent]:
        """``BlockStored`` events for every block now known, parents first
        (a resync snapshot for the router)."""
        events: list[KvEvent] = []
        for entry in self._entries.values():
            for tier in entry.copies:
                events.append(BlockStored(parent_block_hash=entry.parent, block_hashes=list(entry.kv_hashes),
                                          tier=tier, lora_name=entry.lora_name))
        return events

    # ---- per event ------------------------------------------------------

    def _follows_group(self, group_idx: int | None, kind: str | None) -> bool:
        group = 0 if group_idx is None else group_idx
        if kind is not None and kind != _FULL_ATTENTION:
            return False
        if self._group is None:  # follow the first full-attention group that stores
            self._group = group
        return group == self._group

    def _stored(self, ev: VllmBlockStored) -> KvEvent | None:
        stats = self.stats
        if not self._follows_group(ev.group_idx, ev.kv_cache_spec_kind):
            stats.skipped_group += 1
            return None
        tier = medium_to_tier(ev.medium)
        if tier is None:
            stats.skipped_medium += 1
            return None
        num_blocks = len(ev.block_hashes)
        if num_blocks == 0:
            return None
        if ev.block_size % self.block_size:
            stats.skipped_block_size += 1
            return None
        if ev.lora_id is not None and not ev.lora_name:
            stats.skipped_lora += 1
            return None
        spans = self._spans_from_tokens(ev) if ev.token_ids else self._spans_from_known(ev)
        if spans is None:
            return None
        first_parent, kv_per_block = spans
        out: list[int] = []
        parent = first_parent
        for vllm_hash, kv_hashes in zip(ev.block_hashes, kv_per_block, strict=True):
            entry = self._entries.get(vllm_hash)
            if entry is None:
                entry = _Entry(kv_hashes=kv_hashes, parent=parent, lora_name=ev.lora_name)
                self._entries[vllm_hash] = entry
            entry.copies[tier] += 1
            for h in entry.kv_hashes:
                self._held[(tier, h)] += 1
            out.extend(entry.kv_hashes)
            parent = entry.kv_hashes[-1]
        stats.stored_blocks += num_blocks
        return BlockStored(parent_block_hash=first_parent, block_hashes=out, tier=tier, lora_name=ev.lora_name)

    def _parent_kv(self, ev: VllmBlockStored) -> tuple[bool, int | None]:
        if ev.parent_block_hash is None:
            return True, None
        entry = self._entries.get(ev.parent_block_hash)
        if entry is None:
            self.stats.unknown_parent += 1
            return False, None
        return True, entry.kv_hashes[-1]

    def _spans_from_tokens(self, ev: VllmBlockStored) -> tuple[int | None, list[tuple[int, ...]]] | None:
        num_blocks = len(ev.block_hashes)
        num_tokens = len(ev.token_ids)
        if num_tokens % ev.block_size or num_tokens < num_blocks * ev.block_size:
            self.stats.malformed += 1
            return None
        found, parent_kv = self._parent_kv(ev)
        if not found:
            return None
        per_block = ev.block_size // self.block_size
        lead = num_tokens // ev.block_size - num_blocks  # vLLM blocks in the range it skipped
        seq = chain_sequence_hashes(compute_local_block_hashes(ev.token_ids, self.block_size, ev.lora_name),
                                    parent_kv)
        spans = [tuple(seq[(lead + j) * per_block:(lead + j + 1) * per_block]) for j in range(num_blocks)]
        first_parent = parent_kv if lead == 0 else seq[lead * per_block - 1]
        return first_parent, spans

    def _spans_from_known(self, ev: VllmBlockStored) -> tuple[int | None, list[tuple[int, ...]]] | None:
        entries = [self._entries.get(h) for h in ev.block_hashes]
        if any(e is None for e in entries):
            self.stats.unknown_untokenized += sum(1 for e in entries if e is None)
            return None
        return entries[0].parent, [e.kv_hashes for e in entries]

    def _removed(self, ev: VllmBlockRemoved) -> KvEvent | None:
        stats = self.stats
        if self._group is not None and (0 if ev.group_idx is None else ev.group_idx) != self._group:
            stats.skipped_group += 1
            return None
        tier = medium_to_tier(ev.medium)
        if tier is None:
            stats.skipped_medium += 1
            return None
        gone: list[int] = []
        for vllm_hash in ev.block_hashes:
            entry = self._entries.get(vllm_hash)
            if entry is None or entry.copies[tier] <= 0:
                stats.unknown_removed += 1
                continue
            stats.removed_blocks += 1
            entry.copies[tier] -= 1
            if entry.copies[tier] == 0:
                del entry.copies[tier]
            for h in entry.kv_hashes:
                key = (tier, h)
                self._held[key] -= 1
                if self._held[key] <= 0:
                    del self._held[key]
                    gone.append(h)
            if not entry.copies:
                del self._entries[vllm_hash]
        return BlockRemoved(block_hashes=gone, tier=tier) if gone else None

    def _cleared(self) -> KvEvent:
        self.stats.cleared += 1
        self._entries.clear()
        self._held.clear()
        return AllBlocksCleared()


# ---- the ZeroMQ subscriber -------------------------------------------------


@dataclass
class SubscriberStats:
    """Counts kept by :class:`VllmKvEventSubscriber` (cumulative).

    ``last_seq`` is the last batch sequence number applied (None before the
    first). A gap (``seq > last_seq + 1``, or a first ``seq > 0``) means
    batches were lost: the translator's view may miss blocks until they are
    stored again.
    """

    messages: int = 0
    batches: int = 0
    events_emitted: int = 0
    duplicates: int = 0
    gaps: int = 0
    decode_errors: int = 0
    bad_frames: int = 0
    last_seq: int | None = None


KvEventsCallback = Callable[[list[KvEvent]], None]


class VllmKvEventSubscriber:
    """An asyncio task reading vLLM's KV event PUB socket and feeding kvflow events to ``sink``.

    Args:
        endpoint: the ZeroMQ address vLLM publishes on (``KVEventsConfig.endpoint``,
            e.g. ``ipc:///tmp/kvflow-kv-....sock``); this socket connects to it.
        translator: the worker's :class:`KvEventTranslator`.
        sink: called with each non-empty list of translated events
            (typically :meth:`Engine.emit_kv_events`); must not block.
        topic: the ``KVEventsConfig.topic``; only messages of this topic are read.

    A SUB socket may connect before the PUB side binds (ZeroMQ retries), so
    starting this before the engine loses nothing published after the
    connection completes. Batches with ``seq <= last_seq`` are duplicates and
    dropped; gaps are counted and logged (vLLM's optional replay socket is
    not used).

    Raises:
        ImportError: from :meth:`start` when ``pyzmq`` is not installed.
    """

    def __init__(self, endpoint: str, translator: KvEventTranslator, sink: KvEventsCallback, *,
                 topic: str = "") -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.translator = translator
        self.sink = sink
        self.stats = SubscriberStats()
        self._ctx = None
        self._sock = None
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        """True while the receive task runs."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Connect the SUB socket and start the receive task (idempotent).

        Raises:
            ImportError: pyzmq is missing.
        """
        if self.running:
            return
        try:
            import zmq
            import zmq.asyncio
        except ImportError as exc:
            raise ImportError("reading vLLM KV events needs pyzmq (installed with vllm): pip install pyzmq") from exc
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        sock.connect(self.endpoint)
        self._sock = sock
        self._task = asyncio.create_task(self._run(), name=f"vllm-kv-events:{self.endpoint}")

    async def stop(self) -> None:
        """Stop the receive task and close the socket (idempotent)."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                self.handle_frames(frames)
            except Exception:
                log.exception("vLLM KV event batch could not be applied")

    def handle_frames(self, frames: Sequence[bytes]) -> list[KvEvent]:
        """Apply one ZeroMQ message ``(topic, seq, payload)``; returns the events sent to the sink.

        Duplicates, malformed messages and undecodable payloads are counted
        and yield ``[]``.
        """
        stats = self.stats
        stats.messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            stats.bad_frames += 1
            return []
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if stats.last_seq is not None and seq <= stats.last_seq:
            stats.duplicates += 1
            return []
        expected = 0 if stats.last_seq is None else stats.last_seq + 1
        if seq != expected:
            stats.gaps += 1
            log.warning("vLLM KV events: expected batch %d, got %d; %d batches lost", expected, seq, seq - expected)
        stats.last_seq = seq
        try:
            batch = decode_vllm_event_batch(payload)
        except VllmEventDecodeError as exc:
            stats.decode_errors += 1
            log.warning("vLLM KV event batch %d does not decode: %s", seq, exc)
            return []
        stats.batches += 1
        events = self.translator.translate(batch)
        if events:
            stats.events_emitted += len(events)
            self.sink(events)
        return events


def new_ipc_endpoint(prefix: str = "kvflow-kv") -> str:
    """A fresh ``ipc://`` address under the temp directory, for one engine's KV events.

    vLLM's publisher binds ``ipc://`` endpoints, so each engine needs its
    own path; it is kept short because Unix socket paths are limited to
    about 107 bytes.
    """
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock')}"
