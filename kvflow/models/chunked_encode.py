"""Prompt encoding in chunks, with a cache of the chunks already encoded.

Chat traffic resends its history: turn *k+1*'s prompt is turn *k*'s prompt,
the answer and a new question. Encoding it whole costs ~2.5 µs of CPU per
token with Hugging Face ``tokenizers`` (SmolLM2's tokenizer, 27k-token
prompt, on this project's 2-core test machine; ~0.6 µs with ``tiktoken``,
:mod:`kvflow.models.fast_bpe`), the largest per-request cost of the bridge
on long prompts. This
module cuts the text at places where the tokenizer's pre-tokenizer always
splits, encodes each chunk on its own, and keeps the chunks' ids in an LRU
cache, so a shared prefix is encoded once. The chunks that miss are encoded
in one ``encode_batch_fast`` call (parallel across chunks in the Rust
tokenizer, and cheaper than one long call even on one core: 44 vs 75 ms of
CPU for that prompt).

Exactness: the concatenated chunk ids equal the whole text's ids when the
tokenizer is byte-level BPE with the GPT-2 pre-tokenizer regex
(``ByteLevel(use_regex=True, add_prefix_space=False)``), has no normalizer and
no added token that holds a space or strips the spaces beside it: that regex never lets a piece run across
a space standing between two letters, whose right side always starts the
piece ``" word"`` (the ``" ?\\p{L}+"`` branch) and whose left side ends a
letter run, and BPE merges never cross pieces (Radford et al. 2019, GPT-2's
``encoder.py``; Hugging Face ``tokenizers`` ``pre_tokenizers/byte_level.rs``).
:func:`chunkable` checks those conditions; other tokenizers are encoded whole.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CHUNK_CHARS", "CACHE_CHARS", "ChunkCache", "chunkable", "safe_cuts"]

CHUNK_CHARS = 2048
"""Target chunk length in characters (~500 tokens of English). Shorter chunks
share more of a prefix that ends mid-chunk but cost a cache entry each; at
512–8192 characters the cold encode of a 27k-token prompt cost the same."""

CACHE_CHARS = 8 << 20
"""Characters of chunk text the cache keeps (8 Mi ≈ 2M tokens of English): the
text (1–4 bytes per character, by script) plus 4 bytes per token id, 16–40 MiB."""


def safe_cuts(text: str, every: int = CHUNK_CHARS) -> list[int]:
    """Indices where ``text`` may be cut without changing its tokens: each is
    a space with a letter (``str.isalpha``, i.e. Unicode category L) on both
    sides, the first such space at least ``every`` characters after the
    previous cut. The cut puts the space at the start of the right chunk.

    Returns the cut indices in increasing order (empty for short text). Cuts
    depend only on the text up to one character past them, so two texts with
    a common prefix share every cut that lies inside it.
    """
    cuts: list[int] = []
    n = len(text)
    start = 0
    while True:
        p = text.find(" ", start + every)
        while p != -1 and p + 1 < n and not (text[p - 1].isalpha() and text[p + 1].isalpha()):
            p = text.find(" ", p + 1)
        if p == -1 or p + 1 >= n:
            return cuts
        cuts.append(p)
        start = p


def chunkable(backend: Any) -> bool:
    """True when the ``tokenizers.Tokenizer`` ``backend`` encodes a text cut
    at :func:`safe_cuts` into the same ids as the whole (see the module
    docstring for the conditions)."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself is encoded whole
        return False
    normalizer = spec.get("normalizer")
    if normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return False
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        return False
    if (spec.get("model") or {}).get("type") != "BPE" or (spec.get("model") or {}).get("dropout"):
        return False
    # An added token is split out before pre-tokenizing; one holding a space, or one that swallows
    # the spaces beside it (lstrip/rstrip), could match across a cut.
    return not any(" " in str(tok.get("content", "")) or tok.get("lstrip") or tok.get("rstrip")
                   for tok in spec.get("added_tokens") or ())


@dataclass
class ChunkCache:
    """LRU cache of chunk text → token ids, and the chunked encode using it.

    ``max_chars`` bounds the cached text (the ids add 4 bytes per token).
    Safe to share between threads (the bridge encodes in ``asyncio.to_thread``).
    ``hit_chars`` / ``miss_chars`` count the characters served from the cache
    and encoded (short texts included), for the hit rate.
    """

    max_chars: int = CACHE_CHARS
    every: int = CHUNK_CHARS
    hit_chars: int = 0
    miss_chars: int = 0
    _entries: OrderedDict[str, array] = field(default_factory=OrderedDict, repr=False)
    _chars: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encode(self, text: str, encode_batch: Callable[[list[str]], Sequence[Sequence[int]]]) -> list[int]:
        """Ids of ``text`` (shape [tokens]): cached chunks reused, the others
        encoded by one ``encode_batch(chunks) -> ids per chunk`` call (no
        special tokens added) and cached. A text shorter than one chunk is
        encoded whole and not cached.

        Raises:
            whatever ``encode_batch`` raises; nothing is cached then.
        """
        cuts = safe_cuts(text, self.every)
        if not cuts:  # one chunk: nothing for a later prompt to share
            ids = list(encode_batch([text])[0])
            with self._lock:
                self.miss_chars += len(text)
            return ids
        bounds = [0, *cuts, len(text)]
        chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        found: list[array | None] = []
        with self._lock:
            for chunk in chunks:
                ids = self._entries.get(chunk)
                if ids is not None:
                    self._entries.move_to_end(chunk)
                found.append(ids)
        missing = [c for c, ids in zip(chunks, found) if ids is None]
        fresh = iter([array("I", ids) for ids in encode_batch(missing)] if missing else ())
        out: list[int] = []
        with self._lock:
            for i, ids in enumerate(found):
                if ids is None:
                    ids = next(fresh)
                    self._put(chunks[i], ids)
                    self.miss_chars += len(chunks[i])
                else:
                    self.hit_chars += len(chunks[i])
                out.extend(ids)
        return out

    def _put(self, chunk: str, ids: array) -> None:
        if len(chunk) > self.max_chars or chunk in self._entries:
            return
        self._entries[chunk] = ids
        self._chars += len(chunk)
        while self._chars > self.max_chars:
            old, _ = self._entries.popitem(last=False)
            self._chars -= len(old)
