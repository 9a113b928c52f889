"""The encode worker's embedding cache: LRU by media content hash, bounded in bytes.

Encoding the same media again gives the same embeddings (the encoder is
deterministic), so an encode worker keeps each item's embeddings under its
kind and content hash (:func:`~kvflow.schemas.media.media_content_hash`) and
serves a repeat from here. Capacity counts the embeddings' own bytes; the
least recently used entries go first when a new one does not fit, and an
entry larger than the whole capacity is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvflow.schemas import MediaKind
from kvflow.schemas.prompt_embeds import EMBEDS_DTYPES, PromptEmbeds

__all__ = ["CacheStats", "EmbeddingCache"]


@dataclass
class CacheStats:
    """Counters since start: lookups that ``hits``/``misses``, entries evicted."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class EmbeddingCache:
    """Embeddings by ``(kind, content_hash)``; ``capacity_bytes`` (0: nothing is kept)."""

    capacity_bytes: int
    stats: CacheStats = field(default_factory=CacheStats)
    size_bytes: int = 0
    _entries: OrderedDict[tuple[MediaKind, int], tuple[PromptEmbeds, int]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, kind: MediaKind, content_hash: int) -> PromptEmbeds | None:
        """The cached embeddings (now most recently used), or None; counts a hit or a miss."""
        entry = self._entries.get((kind, content_hash))
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end((kind, content_hash))
        self.stats.hits += 1
        return entry[0]

    def put(self, kind: MediaKind, content_hash: int, embeds: PromptEmbeds) -> None:
        """Keep ``embeds`` (its tensor's ``seq_len * hidden * itemsize`` bytes),
        evicting least recently used entries until it fits."""
        nbytes = embeds.shape[0] * embeds.shape[1] * EMBEDS_DTYPES[embeds.dtype]
        key = (kind, content_hash)
        old = self._entries.pop(key, None)
        if old is not None:
            self.size_bytes -= old[1]
        if nbytes > self.capacity_bytes:
            return
        while self.size_bytes + nbytes > self.capacity_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.size_bytes -= freed
            self.stats.evictions += 1
        self._entries[key] = (embeds, nbytes)
        self.size_bytes += nbytes
