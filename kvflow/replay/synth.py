"""Synthetic prompt tokens for traces that carry no text, and their block hashes.

Public traces rarely ship prompts. Mooncake names each 512-token block of a
prompt by an integer ``hash_id`` (equal ids = equal content); Azure gives only
lengths. To drive a real cache we invent token ids with these properties:

* **Hash-id blocks** (Mooncake): token ``j`` of block ``h`` is a pure function
  of ``(h, j)`` — seeded by the hash id only — so equal hash ids give equal
  512-token blocks in every request, and equal block hashes at every router
  block size dividing 512. A prompt's last block is partial: its tokens are
  the first ``input_length - 512*(n-1)`` tokens of its hash id's block.
* **Unique prompts** (Azure): token ``j`` of request ``i`` is a pure function
  of ``(seed, i, j)``, so no two requests share a prefix (beyond chance).
* **Text** (MT-Bench, ShareGPT, kvflow logs without token ids): a word-hash
  tokenizer, one token per word or punctuation mark, each the XXH3 hash of
  the piece modulo the vocabulary. Shared text prefixes give shared token
  prefixes; lengths differ from a real tokenizer's, so pass one (any
  ``encode`` function) where exact ISLs matter.

The mixing function is SplitMix64's finalizer (Steele, Lea, Flood, "Fast
splittable pseudorandom number generators", OOPSLA 2014) and the reduction to
the vocabulary is Lemire's multiply-shift ("Fast random integer generation in
an interval", ACM TOMACS 2019), vectorised with numpy: a 12k-token prompt
costs ~0.15 ms, most of it building the Python list.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvflow.schemas.block_hash import chain_sequence_hashes, compute_local_block_hashes

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "HASH_BLOCK_TOKENS",
    "hash_id_tokens",
    "unique_tokens",
    "word_hash_tokenize",
    "Tokenizer",
    "PrefixHasher",
]

DEFAULT_VOCAB_SIZE = 32000
"""Synthetic token ids fall in ``[0, 32000)`` (the Llama-2 vocabulary size)."""

HASH_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_id`` block (kvcache-ai/Mooncake ``FAST25-release`` trace description)."""

Tokenizer = Callable[[str], list[int]]
"""Text → token ids. Any Hugging Face ``tokenizer.encode`` fits."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_UNIQUE_SALT = 0x5EED_0000_0000_0000  # keeps unique-prompt streams apart from hash-id blocks


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, in place, on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x ^= x >> _S30
        x *= _M1
        x ^= x >> _S27
        x *= _M2
        x ^= x >> _S31
    return x


def _offsets(start: int, stop: int) -> np.ndarray:
    """``(pos + 1) * golden`` for positions ``[start, stop)`` as uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        return (np.arange(start + 1, stop + 1, dtype=np.uint64)) * _GOLDEN


_INT_TABLE_MAX = 1 << 18
_int_tables: dict[int, np.ndarray] = {}


def _int_table(vocab_size: int) -> np.ndarray | None:
    """An object array holding the Python ints ``0..vocab_size-1`` (None for huge vocabularies).

    Indexing it hands out shared int objects instead of allocating one per
    token: a simulation keeps thousands of 12k-token prompts alive, and
    allocating their ints is what made building them slow (~6x).
    """
    if vocab_size > _INT_TABLE_MAX:
        return None
    table = _int_tables.get(vocab_size)
    if table is None:
        table = _int_tables[vocab_size] = np.array(range(vocab_size), dtype=object)
    return table


def _to_vocab(x: np.ndarray, vocab_size: int) -> list[int]:
    """Map uniform uint64s into ``[0, vocab_size)`` by multiply-shift (Lemire 2019), as a list."""
    if not 1 <= vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    x >>= _S32
    x *= np.uint64(vocab_size)
    x >>= _S32
    table = _int_table(vocab_size)
    return table[x.view(np.int64)].tolist() if table is not None else x.view(np.int64).tolist()


def _bases(keys: Sequence[int]) -> np.ndarray:
    """Per-key stream bases ``mix(key * golden + golden)``."""
    with np.errstate(over="ignore"):
        k = np.asarray(keys, dtype=np.uint64) * _GOLDEN + _GOLDEN
    return _mix64(k)


def hash_id_tokens(hash_ids: Sequence[int], isl: int, vocab_size: int = DEFAULT_VOCAB_SIZE,
                   block_tokens: int = HASH_BLOCK_TOKENS) -> list[int]:
    """Token ids of a prompt made of ``hash_ids`` blocks, ``isl`` tokens long.

    Token ``j`` of block ``h`` is ``mix(base(h) + (j+1)·golden)`` reduced to
    the vocabulary, ``base(h) = mix(h·golden + golden)``. Block ``k`` holds
    tokens ``[k*block_tokens, (k+1)*block_tokens)``; the last block is cut to
    what remains of ``isl``. If ``isl`` exceeds ``len(hash_ids) *
    block_tokens`` the excess continues the last id's stream past
    ``block_tokens`` (never the case in the Mooncake trace).

    Returns:
        ``isl`` ints in ``[0, vocab_size)``.

    Raises:
        ValueError: ``hash_ids`` is empty while ``isl > 0``; ``vocab_size``
            outside ``[1, 2**32]``.
    """
    if isl <= 0:
        return []
    if not hash_ids:
        raise ValueError("hash_ids is empty")
    n = min(len(hash_ids), -(-isl // block_tokens))
    bases = _bases(hash_ids[:n])
    with np.errstate(over="ignore"):
        x = (bases[:, None] + _offsets(0, block_tokens)[None, :]).ravel()[:isl]
        if isl > n * block_tokens:
            x = np.concatenate([x, bases[-1] + _offsets(block_tokens, isl - (n - 1) * block_tokens)])
    return _to_vocab(_mix64(x), vocab_size)


def unique_tokens(seed: int, index: int, isl: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """Token ids of request ``index``'s prompt, unique per ``(seed, index)``.

    Returns:
        ``isl`` ints in ``[0, vocab_size)``.
    """
    if isl <= 0:
        return []
    key = (_UNIQUE_SALT ^ (seed * 0x1_0000_0001) ^ index) & 0xFFFF_FFFF_FFFF_FFFF
    with np.errstate(over="ignore"):
        x = _bases([key])[0] + _offsets(0, isl)
    return _to_vocab(_mix64(x), vocab_size)


_WORD = re.compile(r"\w+|[^\w\s]")


def word_hash_tokenize(text: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """A stand-in tokenizer: one token per word or punctuation mark.

    Each piece maps to ``xxh3_64(piece) mod vocab_size``; deterministic and
    model-free, so equal text prefixes give equal token prefixes.
    """
    return [xxhash.xxh3_64_intdigest(p.encode()) % vocab_size for p in _WORD.findall(text)]


class PrefixHasher:
    """Chained block hashes of hash-id prompts without building token lists.

    Local block hashes depend only on a block's own tokens, and the router's
    ``block_size`` divides 512, so the local hashes of each hash id's block are
    computed once and cached; a prompt's sequence hashes are then the chain
    (:func:`~kvflow.schemas.block_hash.chain_sequence_hashes`) of the
    concatenated locals. Results equal
    ``compute_block_hashes(hash_id_tokens(...), block_size)``.

    Raises:
        ValueError: ``block_size`` does not divide ``block_tokens``.
    """

    def __init__(self, block_size: int, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 block_tokens: int = HASH_BLOCK_TOKENS, lora_name: str | None = None) -> None:
        if block_size < 1 or block_tokens % block_size:
            raise ValueError(f"block size {block_size} must divide the hash-id block of {block_tokens} tokens")
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self.lora_name = lora_name
        self._locals: dict[int, list[int]] = {}

    def _local(self, hash_id: int) -> list[int]:
        got = self._locals.get(hash_id)
        if got is None:
            tokens = hash_id_tokens((hash_id,), self.block_tokens, self.vocab_size, self.block_tokens)
            got = self._locals[hash_id] = compute_local_block_hashes(tokens, self.block_size, self.lora_name)
        return got

    def block_hashes(self, hash_ids: Sequence[int], isl: int) -> list[int]:
        """Sequence hashes of the ``isl // block_size`` full blocks of the prompt.

        Raises:
            ValueError: ``isl`` exceeds ``len(hash_ids) * block_tokens``.
        """
        if isl > len(hash_ids) * self.block_tokens:
            raise ValueError(f"isl {isl} exceeds {len(hash_ids)} hash-id blocks")
        locals_: list[int] = []
        full, rest = divmod(isl, self.block_tokens)
        for h in hash_ids[:full]:
            locals_.extend(self._local(h))
        if rest >= self.block_size:
            locals_.extend(self._local(hash_ids[full])[: rest // self.block_size])
        return chain_sequence_hashes(locals_)
