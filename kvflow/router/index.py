"""The global KV index: which worker caches which block, per tier.

The router folds every worker's :class:`~kvflow.schemas.KvEventBatch` into
one :class:`KvIndex` and asks it, per request, how many leading prompt
blocks each worker already holds (:meth:`KvIndex.find_matches`).

Design — one block map per tier, hash -> bitmask of the workers holding it:

* Block hashes are *sequence* hashes (:mod:`kvflow.schemas.block_hash`): hash
  ``i`` already names blocks ``0..i`` together, so a tree adds nothing to
  prefix identity; a flat map from block hash to the set of workers holding
  it answers the same questions as a radix tree, without per-node objects.
* Each worker gets a slot; 64 slots share one ``BlockMap`` (per tier), whose
  entries are ``(u64 hash, u64 worker mask)``. The map is the compiled
  :mod:`kvflow.router._blockmap` (open addressing, linear probing,
  backward-shift deletion: 16 bytes per cached block, no Python object per
  block); where it was not built, :mod:`kvflow.router._blockmap_py` behaves
  the same, slower (:data:`COMPILED` says which one is in use).
* A stored event sets the worker's bit on each hash, a removed event clears
  it (dropping the entry when no worker holds the block), ``cleared`` drops
  the worker's bit everywhere: each a single call into the map per event.
  From Kafka the router applies each record as decoded into a
  :class:`~kvflow.schemas.KvWireBatch`: an event's hashes reach the compiled
  map as a ``'Q'`` memoryview of the record's bytes, no int per block.
* :meth:`KvIndex.find_matches` walks the prompt's hashes once for all
  workers, AND-ing the masks; a worker's overlap is the depth at which its
  bit drops out, and the walk ends when no bit is left. One probe per block
  of the longest match, plus one — the work a radix-tree walk does, with
  one cache line per block.
* Earlier designs, measured with ``bench/kv_index.py``: one Python ``set``
  per worker (events fast, but a lookup walks every worker's matched prefix
  separately, about 0.7x Dynamo's lookups) and a Python ``dict`` of
  bitmasks (lookups faster, events about 3x slower than the sets). Figures
  for this design are in ``docs/benchmarks.md``.
* ``parent_block_hash`` is not needed: the chain is inside the hashes. An
  orphan block (parent never stored or already evicted) is recorded but
  never counted, since a worker's match stops at its first missing block;
  if the missing parent is stored again later, the orphan counts again, as
  it would in the engine's own prefix cache.
* Storing a block a worker already holds is idempotent (set semantics, as an
  engine's prefix cache holds one copy of a block per tier).

Tiers: ``find_matches`` reports, per worker, the leading run of prompt
blocks the worker holds in *any* tier, split by the fastest tier holding
each block (device before host before disk). The three counts are disjoint
and sum to the worker's matched prefix, so a cost function can credit each
tier at its own weight without double counting.

Event ids: each worker's batches carry a monotonic ``event_id``. A batch
with ``event_id <= last`` is a duplicate and ignored; ``event_id > last + 1``
is a gap: the batch is still applied (newer truth beats nothing), the
cursor moves to it, and the worker is marked as needing a dump
(:attr:`ApplyResult.gap`, :meth:`KvIndex.workers_needing_dump`) until a
``dump=True`` batch arrives and replaces its state wholesale. A worker's
first batch is accepted whatever its id (the router may start mid-stream;
it is flagged as a gap when ``event_id > 0``). A worker that restarts under
the same id restarts its ids at 0, so the router must call
:meth:`KvIndex.remove_worker` when a worker leaves or restarts (stopped or
expired heartbeat, or a new ``started_ms``).

Pure state: no I/O, no clock. Two indexes fed the same batches in the same
order are equal (``==``); see :meth:`KvIndex.snapshot`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvflow.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvTier,
    KvWireBatch,
)
from kvflow.schemas.block_hash import BlockSizeMismatch
from kvflow.schemas.kv_events import KvWireRemoved, KvWireStored

try:
    from kvflow.router._blockmap import BlockMap
    COMPILED = True
except ImportError:  # no C compiler at install time
    from kvflow.router._blockmap_py import BlockMap  # type: ignore[assignment]
    COMPILED = False

__all__ = ["COMPILED", "ApplyResult", "BlockSizeMismatch", "KvIndex", "OverlapScores"]

_SLOTS = 64  # workers per BlockMap (one u64 mask)

_TIERS = (KvTier.device, KvTier.host, KvTier.disk)
_TIER_POS = {KvTier.device: 0, KvTier.host: 1, KvTier.disk: 2, "device": 0, "host": 1, "disk": 2}
_EMPTY: Mapping[str, int] = MappingProxyType({})
_DEVICE = KvTier.device
_AS_IS = (list, tuple, memoryview)  # hash containers the block maps take without a copy


@dataclass(slots=True)
class ApplyResult:
    """What :meth:`KvIndex.apply` did with one batch.

    Attributes:
        worker_id: the batch's worker.
        applied: the batch changed (or replaced) the index.
        duplicate: ``event_id`` was <= the last seen; nothing was done.
        gap: event ids were skipped before this batch (``expected_event_id``
            was due); the router should ask the worker for a dump.
        expected_event_id: the id that was due (None for a worker's first
            batch or a dump).
        events: events applied from the batch (0 when ignored).
    """

    worker_id: str
    applied: bool
    duplicate: bool = False
    gap: bool = False
    expected_event_id: int | None = None
    events: int = 0


class OverlapScores:
    """Per-worker leading prompt blocks cached, split by tier.

    ``device[w] + host[w] + disk[w]`` is the length of the longest prompt
    prefix worker ``w`` holds in any tier; each block counts in the fastest
    tier holding it. Workers with no match are absent. The mappings must not
    be mutated (empty ones are shared).
    """

    __slots__ = ("device", "disk", "host")

    def __init__(self, device: Mapping[str, int], host: Mapping[str, int] = _EMPTY,
                 disk: Mapping[str, int] = _EMPTY) -> None:
        self.device = device
        self.host = host
        self.disk = disk

    def prefix(self, worker_id: str) -> int:
        """Matched prefix length of ``worker_id`` in blocks, all tiers together."""
        return self.device.get(worker_id, 0) + self.host.get(worker_id, 0) + self.disk.get(worker_id, 0)

    def workers(self) -> set[str]:
        """Workers with a non-empty match."""
        return set(self.device) | set(self.host) | set(self.disk)

    def __repr__(self) -> str:
        return f"OverlapScores(device={dict(self.device)}, host={dict(self.host)}, disk={dict(self.disk)})"


class KvIndex:
    """Global map of cached KV blocks across workers (see the module docstring).

    Args:
        block_size: tokens per block of every batch this index accepts (>= 1).
        block_map: the map type (``BlockMap`` of :mod:`kvflow.router._blockmap`
            or :mod:`kvflow.router._blockmap_py`); default the compiled one
            when built.

    Raises:
        ValueError: ``block_size < 1``.
    """

    def __init__(self, block_size: int, block_map: type | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._map_type = block_map or BlockMap
        self._slot: dict[str, int] = {}  # worker -> slot (group = slot // 64, bit = slot % 64)
        self._free: list[int] = []  # released slots, a min-heap (lowest reused first)
        self._maps: list[tuple[Any, Any, Any]] = []  # per group: (device, host, disk) BlockMaps
        self._names: list[list[str | None]] = []  # per group: worker id by bit
        self._tiered: set[str] = set()  # workers holding any host or disk block
        self._cursor: dict[str, int] = {}  # worker -> last event id applied
        self._needs_dump: set[str] = set()

    # ---- workers ---------------------------------------------------------

    def _where(self, worker_id: str) -> tuple[tuple[Any, Any, Any], int]:
        """The worker's group maps and bit, allocating a slot for a new worker."""
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = heapq.heappop(self._free) if self._free else len(self._slot)
            self._slot[worker_id] = slot
            group, bit = divmod(slot, _SLOTS)
            if group == len(self._maps):
                new = self._map_type
                self._maps.append((new(), new(), new()))
                self._names.append([None] * _SLOTS)
            self._names[group][bit] = worker_id
        group, bit = divmod(slot, _SLOTS)
        return self._maps[group], bit

    def workers(self) -> list[str]:
        """Workers the index knows (from any batch or event), sorted."""
        return sorted(self._slot)

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id``: its blocks, event cursor and dump request. No-op if unknown.

        O(blocks in the worker's group): its bit is cleared in every entry.
        """
        slot = self._slot.pop(worker_id, None)
        if slot is not None:
            group, bit = divmod(slot, _SLOTS)
            for m in self._maps[group]:
                m.clear(bit)
            self._names[group][bit] = None
            heapq.heappush(self._free, slot)
        self._tiered.discard(worker_id)
        self._cursor.pop(worker_id, None)
        self._needs_dump.discard(worker_id)

    def workers_needing_dump(self) -> list[str]:
        """Workers whose event stream had a gap and whose dump has not arrived, sorted."""
        return sorted(self._needs_dump)

    def last_event_id(self, worker_id: str) -> int | None:
        """Last event id applied for ``worker_id`` (None if none)."""
        return self._cursor.get(worker_id)

    def num_blocks(self, worker_id: str, tier: KvTier | str = KvTier.device) -> int:
        """Blocks ``worker_id`` holds in ``tier`` (0 if unknown)."""
        if worker_id not in self._slot:
            return 0
        maps, bit = self._where(worker_id)
        return maps[_TIER_POS[tier]].count(bit)

    def held(self, worker_id: str, tier: KvTier | str = KvTier.device) -> set[int]:
        """The block hashes ``worker_id`` holds in ``tier`` (empty if unknown). O(blocks in its group)."""
        if worker_id not in self._slot:
            return set()
        maps, bit = self._where(worker_id)
        return set(maps[_TIER_POS[tier]].hashes(bit))

    # ---- events ----------------------------------------------------------

    def apply(self, batch: KvEventBatch | KvWireBatch) -> ApplyResult:
        """Fold one worker's batch into the index, honouring event ids.

        ``batch`` is a :class:`~kvflow.schemas.KvEventBatch` or, on the
        router's hot path, the :class:`~kvflow.schemas.KvWireBatch` that
        :func:`~kvflow.schemas.decode_kv_frame` returns for a record (its
        hashes go to the block maps as u64 buffers, no int object per block;
        it must come from that function, which puts them in native order).
        A ``dump`` batch replaces the worker's state and resets its cursor to
        ``batch.event_id``. Otherwise duplicates are ignored and gaps are
        applied but reported (see the module docstring).

        Raises:
            BlockSizeMismatch: ``batch.block_size != self.block_size`` (hashes
                of another block size can never match; failing loudly beats
                silently scoring zero overlap).
        """
        if batch.block_size != self.block_size:
            raise BlockSizeMismatch(
                f"KV events of worker {batch.worker_id} use block size {batch.block_size}, "
                f"the index uses {self.block_size}"
            )
        worker_id, event_id = batch.worker_id, batch.event_id
        fold = self._apply_wire_events if type(batch) is KvWireBatch else self._apply_events
        if batch.dump:
            self._clear(worker_id)
            self._cursor[worker_id] = event_id
            self._needs_dump.discard(worker_id)
            return ApplyResult(worker_id, True, events=fold(worker_id, batch.events))
        last = self._cursor.get(worker_id)
        if last is not None and event_id <= last:
            return ApplyResult(worker_id, False, duplicate=True, expected_event_id=last + 1)
        gap = event_id > 0 if last is None else event_id > last + 1
        if gap:
            self._needs_dump.add(worker_id)
        self._cursor[worker_id] = event_id
        n = fold(worker_id, batch.events)
        return ApplyResult(worker_id, True, gap=gap, expected_event_id=None if last is None else last + 1, events=n)

    def on_kv_events(self, worker_id: str, events: list[KvEvent]) -> None:
        """Apply events delivered in-process, in order, without event ids.

        For a feed that cannot lose or repeat events (the offline simulator's
        ``kv_hook``); batches from Kafka go through :meth:`apply`.
        """
        self._apply_events(worker_id, events)

    def store_blocks(self, worker_id: str, block_hashes: Iterable[int], tier: KvTier | str = KvTier.device) -> None:
        """Record that ``worker_id`` now holds ``block_hashes`` in ``tier`` (idempotent).

        ``block_hashes``: ints, or a ``'Q'`` memoryview of native u64 (used as is).

        Raises:
            ValueError: a hash outside [0, 2**64).
        """
        pos = _TIER_POS[tier]
        maps, bit = self._where(worker_id)
        maps[pos].store(bit, block_hashes if isinstance(block_hashes, _AS_IS) else list(block_hashes))
        if pos:
            self._tiered.add(worker_id)

    def remove_blocks(self, worker_id: str, block_hashes: Iterable[int], tier: KvTier | str = KvTier.device) -> None:
        """Record that ``worker_id`` no longer holds ``block_hashes`` in ``tier`` (unknown ones ignored).

        ``block_hashes`` as for :meth:`store_blocks`.

        Raises:
            ValueError: a hash outside [0, 2**64).
        """
        if worker_id not in self._slot:
            return
        pos = _TIER_POS[tier]
        maps, bit = self._where(worker_id)
        maps[pos].remove(bit, block_hashes if isinstance(block_hashes, _AS_IS) else list(block_hashes))
        if pos and not maps[1].count(bit) and not maps[2].count(bit):
            self._tiered.discard(worker_id)

    def _apply_events(self, worker_id: str, events: Iterable[KvEvent]) -> int:
        maps, bit = self._where(worker_id)
        device = maps[0]
        n = 0
        for ev in events:
            n += 1
            kind = type(ev)
            if kind is BlockStored:
                if ev.tier is _DEVICE:  # the hot path
                    device.store(bit, ev.block_hashes)
                else:
                    self.store_blocks(worker_id, ev.block_hashes, ev.tier)
            elif kind is BlockRemoved:
                if ev.tier is _DEVICE:
                    device.remove(bit, ev.block_hashes)
                else:
                    self.remove_blocks(worker_id, ev.block_hashes, ev.tier)
            elif kind is AllBlocksCleared:
                self._clear(worker_id)
            else:  # pragma: no cover - the schema's discriminated union has no other member
                raise TypeError(f"unknown KV event {kind.__name__}")
        return n

    def _apply_wire_events(self, worker_id: str, events: list) -> int:
        """:meth:`_apply_events` for the events of a decoded :class:`~kvflow.schemas.KvWireBatch`."""
        maps, bit = self._where(worker_id)
        device = maps[0]
        for ev in events:
            kind = type(ev)
            if kind is KvWireStored:
                if ev.tier is _DEVICE:
                    device.store(bit, ev.block_hashes.cast("Q"))
                else:
                    self.store_blocks(worker_id, ev.block_hashes.cast("Q"), ev.tier)
            elif kind is KvWireRemoved:
                if ev.tier is _DEVICE:
                    device.remove(bit, ev.block_hashes.cast("Q"))
                else:
                    self.remove_blocks(worker_id, ev.block_hashes.cast("Q"), ev.tier)
            else:
                self._clear(worker_id)
        return len(events)

    def _clear(self, worker_id: str) -> None:
        """Drop every block of ``worker_id`` (all tiers), keeping the worker known."""
        maps, bit = self._where(worker_id)
        for m in maps:
            m.clear(bit)
        self._tiered.discard(worker_id)

    # ---- queries ---------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int]) -> OverlapScores:
        """Per-worker leading prompt blocks cached, by tier.

        Args:
            block_hashes: the prompt's chained sequence hashes, block 0 first
                (:func:`kvflow.schemas.block_hash.compute_block_hashes` at this
                index's block size); a list or tuple is used as is.

        Returns:
            :class:`OverlapScores`; a worker's count stops at its first
            block held in no tier.

        Raises:
            ValueError: a hash outside [0, 2**64).
        """
        if not isinstance(block_hashes, (list, tuple)):
            block_hashes = list(block_hashes)
        device: dict[str, int] = {}
        if not self._tiered:
            for maps, names in zip(self._maps, self._names):
                maps[0].match(block_hashes, names, device)
            return OverlapScores(device)
        return self._match_tiers(block_hashes, device)

    def _match_tiers(self, block_hashes: Sequence[int], device: dict[str, int]) -> OverlapScores:
        """Prefix lengths over all tiers, each block credited to its fastest tier.

        The compiled device walk runs for every worker; a worker holding host
        or disk blocks then continues in Python from where its device run
        ended (engines evict a prefix's tail first, so the device run is
        usually the head and only the offloaded tail is walked here: about
        20% faster than walking whole prompts in Python on a synthetic index
        of 8 tiered workers, 200-block prompts, 120 of them on device).
        """
        for maps, names in zip(self._maps, self._names):
            maps[0].match(block_hashes, names, device)
        off_host: dict[str, int] = {}
        off_disk: dict[str, int] = {}
        for worker_id in sorted(self._tiered):
            (dev, host, disk), bit = self._where(worker_id)
            b = 1 << bit
            on_dev = device.get(worker_id, 0)
            on_host = on_disk = 0
            for h in block_hashes[on_dev:]:
                if dev.get(h) & b:
                    on_dev += 1
                elif host.get(h) & b:
                    on_host += 1
                elif disk.get(h) & b:
                    on_disk += 1
                else:
                    break
            if on_dev:
                device[worker_id] = on_dev
            if on_host:
                off_host[worker_id] = on_host
            if on_disk:
                off_disk[worker_id] = on_disk
        return OverlapScores(device, off_host, off_disk)

    # ---- state comparison ------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The index's full logical state, JSON-friendly.

        ``{"block_size": int, "needs_dump": [ids], "workers": {id: {"event_id":
        int | None, "device": [sorted hashes], "host": [...], "disk": [...]}}}``.
        Independent of slot assignment. O(blocks · log blocks).
        """
        workers = {}
        for w in sorted(self._slot):
            maps, bit = self._where(w)
            workers[w] = {"event_id": self._cursor.get(w),
                          **{t.value: sorted(maps[i].hashes(bit)) for i, t in enumerate(_TIERS)}}
        return {"block_size": self.block_size, "needs_dump": sorted(self._needs_dump), "workers": workers}

    def __eq__(self, other: object) -> bool:
        """Same block size, workers, blocks per tier, cursors and pending dumps (slots may differ)."""
        if not isinstance(other, KvIndex):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    __hash__ = None  # type: ignore[assignment]  # mutable
