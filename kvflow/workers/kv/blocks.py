"""A paged KV block pool with prefix caching, shared by the engines.

The pool owns ``num_blocks`` physical blocks of ``block_size`` tokens and the
block table of every sequence. It does no I/O and keeps no clock: engines call
it from their step, and it records one KV event per cache change, which the
engine drains with :meth:`BlockPool.take_events` once per step.

Block life cycle::

    free ──allocate──► in use (ref >= 1) ──commit──► in use + cached (has a hash)
      ▲                    │ free (ref -> 0)                │ free (ref -> 0)
      └────────────────────┘                                ▼
      ▲                                        cached, evictable (LRU order)
      └──────────── evicted to make room (BlockRemoved) ◄───┘

A block is *committed* once it is full and its KV computed: it gets its
chained sequence hash (:mod:`kvflow.schemas.block_hash`) and a ``BlockStored``
event. A later sequence whose leading hashes match reuses committed blocks
instead of recomputing them (prefix caching) — whether they are still in use
by another sequence (ref count > 1) or already released (taken back off the
LRU list). Blocks are evicted least-recently-released first; a sequence's
blocks are released tail first, so its tail is evicted before its head (the
head is the part other requests are likeliest to share). This follows vLLM's
``KVCacheManager`` / free-block queue behaviour.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvflow.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["BlockPool", "NoFreeBlocks"]


class NoFreeBlocks(RuntimeError):
    """Not enough free or evictable blocks for an allocation.

    Raised by :meth:`BlockPool.allocate`, which then leaves the pool
    unchanged; the caller decides whether to wait or to preempt a sequence.
    ``needed`` and ``available`` count blocks.
    """

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"need {needed} KV blocks, only {available} free or evictable")
        self.needed = needed
        self.available = available


@dataclass
class _SeqBlocks:
    """One sequence's block table: physical ids in token order."""

    block_ids: list[int] = field(default_factory=list)
    num_committed: int = 0  # leading blocks that carry a hash (shared or committed by us)
    last_hash: int | None = None  # sequence hash of block num_committed - 1


class BlockPool:
    """Paged KV blocks with ref counts, prefix reuse and LRU eviction.

    Args:
        num_blocks: physical blocks, >= 1.
        block_size: tokens per block, >= 1.
        enable_prefix_caching: when false nothing is ever cached: no reuse,
            no hashes kept, no KV events.
        on_evict: called as ``on_evict(block_hash, parent_hash)`` for each
            cached block evicted to make room, before its slot is reused (the
            engine offloads it to a lower tier, :mod:`kvflow.workers.kv.tiers`).

    Sequences are named by any hashable ``seq_id`` (a request id).
    ``block_hashes`` arguments are chained sequence hashes of a sequence's
    full blocks, from block 0 (see :func:`kvflow.schemas.block_hash.compute_block_hashes`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 on_evict: Callable[[int, int | None], None] | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_evict = on_evict
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks
        self._lora: list[str | None] = [None] * num_blocks
        # Never-used / uncached free blocks; popped from the end (LIFO keeps it O(1)).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks with ref 0, oldest release first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Committed blocks by sequence hash; insertion order is commit order.
        self._cached: dict[int, int] = {}
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._events: list[KvEvent] = []
        self._num_used = 0

    # ---- queries -------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._num_used

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used, released uncached, or evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Committed blocks (in use or evictable) that a prefix can hit."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """``num_used_blocks / num_blocks`` in [0, 1]."""
        return self._num_used / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Number of leading ``block_hashes`` currently cached (no side effects)."""
        if not self.enable_prefix_caching:
            return 0
        cached = self._cached
        n = 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n

    def has_seq(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` holds blocks."""
        return seq_id in self._seqs

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's physical block ids, in token order.

        Raises:
            KeyError: unknown ``seq_id``.
        """
        return list(self._seqs[seq_id].block_ids)

    def num_seq_blocks(self, seq_id: Hashable) -> int:
        """Blocks allocated to ``seq_id`` (0 if it holds none)."""
        seq = self._seqs.get(seq_id)
        return len(seq.block_ids) if seq is not None else 0

    # ---- allocation ----------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int, block_hashes: Sequence[int] = ()) -> int:
        """Make ``seq_id`` hold enough blocks for ``num_tokens`` tokens.

        On a sequence's first call, its leading ``block_hashes`` that are
        cached are reused (ref count +1) instead of allocated; pass only the
        hashes the engine may skip computing. Later calls grow the table.

        Returns:
            Blocks reused from the prefix cache (0 on later calls).

        Raises:
            NoFreeBlocks: not enough free + evictable blocks; nothing changed.
        """
        seq = self._seqs.get(seq_id)
        hits: list[int] = []
        if seq is None:
            if self.enable_prefix_caching:
                cached = self._cached
                for h in block_hashes:
                    bid = cached.get(h)
                    if bid is None:
                        break
                    hits.append(bid)
            have = len(hits)
        else:
            have = len(seq.block_ids)
        need_new = max(self.blocks_for_tokens(num_tokens) - have, 0)
        if need_new == 0 and seq is not None:
            return 0
        # Hits sitting on the LRU list stop being evictable once we take them.
        hits_evictable = sum(1 for bid in hits if self._ref[bid] == 0)
        available = len(self._free) + len(self._evictable) - hits_evictable
        if need_new > available:
            raise NoFreeBlocks(need_new, available)

        if seq is None:
            seq = self._seqs[seq_id] = _SeqBlocks()
            for bid in hits:
                self._take(bid)
            seq.block_ids.extend(hits)
            seq.num_committed = len(hits)
            seq.last_hash = block_hashes[len(hits) - 1] if hits else None
        removed: list[int] = []
        ids = seq.block_ids
        for _ in range(need_new):
            ids.append(self._new_block(removed))
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed))
        return len(hits)

    def _take(self, bid: int) -> None:
        if self._ref[bid] == 0:
            self._evictable.pop(bid, None)
            self._num_used += 1
        self._ref[bid] += 1

    def _new_block(self, removed: list[int]) -> int:
        if self._free:
            bid = self._free.pop()
        else:
            bid, _ = self._evictable.popitem(last=False)  # least recently released
            h = self._hash[bid]
            del self._cached[h]  # type: ignore[arg-type]
            removed.append(h)  # type: ignore[arg-type]
            if self.on_evict is not None:
                self.on_evict(h, self._parent[bid])  # type: ignore[arg-type]
            self._hash[bid] = self._parent[bid] = self._lora[bid] = None
        self._ref[bid] = 1
        self._num_used += 1
        return bid

    def commit(self, seq_id: Hashable, block_hashes: Sequence[int], lora_name: str | None = None) -> None:
        """Record that the sequence's first ``len(block_hashes)`` blocks are full and computed.

        Blocks not committed before get their hash and one ``BlockStored``
        event (parent = the hash before them). If another block already holds
        a hash (two sequences computed the same prefix at once), the first one
        stays cached and ours is left unnamed, with no event.

        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: more hashes than the sequence has blocks.
        """
        seq = self._seqs[seq_id]
        n = len(block_hashes)
        if n <= seq.num_committed:
            return
        if n > len(seq.block_ids):
            raise ValueError(f"{n} hashes for a sequence holding {len(seq.block_ids)} blocks")
        if not self.enable_prefix_caching:
            seq.num_committed = n
            return
        parent = seq.last_hash
        stored: list[int] = []
        first_parent = parent
        cached = self._cached
        for i in range(seq.num_committed, n):
            h = block_hashes[i]
            bid = seq.block_ids[i]
            if h not in cached and self._hash[bid] is None:
                cached[h] = bid
                self._hash[bid] = h
                self._parent[bid] = parent
                self._lora[bid] = lora_name
                if not stored:
                    first_parent = parent
                elif stored[-1] != parent:  # a duplicate broke the run: flush it
                    self._events.append(BlockStored(parent_block_hash=first_parent, block_hashes=stored, lora_name=lora_name))
                    stored, first_parent = [], parent
                stored.append(h)
            parent = h
        if stored:
            self._events.append(BlockStored(parent_block_hash=first_parent, block_hashes=stored, lora_name=lora_name))
        seq.num_committed = n
        seq.last_hash = parent

    def free(self, seq_id: Hashable) -> None:
        """Release all of ``seq_id``'s blocks (no-op if it holds none).

        Blocks whose ref count drops to 0 become evictable if committed
        (released tail first, so the tail is evicted first) or free otherwise.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        ref, hashes = self._ref, self._hash
        for bid in reversed(seq.block_ids):
            ref[bid] -= 1
            if ref[bid] == 0:
                self._num_used -= 1
                if hashes[bid] is not None:
                    self._evictable[bid] = None
                else:
                    self._free.append(bid)

    def reset(self) -> None:
        """Drop every sequence and cached block; records ``AllBlocksCleared``."""
        n = self.num_blocks
        self._ref = [0] * n
        self._hash = [None] * n
        self._parent = [None] * n
        self._lora = [None] * n
        self._free = list(range(n - 1, -1, -1))
        self._evictable.clear()
        self._cached.clear()
        self._seqs.clear()
        self._num_used = 0
        if self.enable_prefix_caching:
            self._events.append(AllBlocksCleared())

    # ---- events ----------------------------------------------------------

    def take_events(self) -> list[KvEvent]:
        """KV events recorded since the last call, in order; clears them."""
        events, self._events = self._events, []
        return events

    def dump(self) -> list[KvEvent]:
        """``BlockStored`` events describing every cached block now (for resync).

        In commit order, so a parent still cached precedes its children;
        consecutive chains are grouped into one event. Pending events are not
        touched.
        """
        events: list[KvEvent] = []
        run: list[int] = []
        run_parent: int | None = None
        run_lora: str | None = None
        for h, bid in self._cached.items():
            parent, lora = self._parent[bid], self._lora[bid]
            if run and parent == run[-1] and lora == run_lora:
                run.append(h)
                continue
            if run:
                events.append(BlockStored(parent_block_hash=run_parent, block_hashes=run, lora_name=run_lora))
            run, run_parent, run_lora = [h], parent, lora
        if run:
            events.append(BlockStored(parent_block_hash=run_parent, block_hashes=run, lora_name=run_lora))
        return events
