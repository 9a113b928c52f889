"""Block hashing: the names kvflow gives to KV cache blocks.

Part of the wire contract: KV events, the router's KV index and every
worker engine speak in these hashes, so they live with the records.

A prompt is cut into full blocks of ``block_size`` tokens (a trailing partial
block is never hashed). Each block gets two 64-bit hashes:

* the **local** hash — XXH3-64 over the block's token ids written as u32
  little-endian bytes, seeded with :data:`XXH3_SEED` (1337). It depends only on
  the block's own tokens;
* the **sequence** (chained) hash — ``seq[0] = local[0]`` and
  ``seq[i] = XXH3-64(seq[i-1] ‖ local[i])``, both written as u64 little-endian
  (16 bytes), seed 1337. It names a block *and its whole prefix*, so two
  workers holding the same sequence hash hold the same prefix. KV events and
  the router's KV index speak in sequence hashes.

This is the scheme of NVIDIA Dynamo's KV router, so hashes are comparable
with it. Checked against ai-dynamo/dynamo sources:

* ``lib/kv-router/src/protocols.rs`` (and the older
  ``lib/llm/src/kv_router/protocols.rs``): ``XXH3_SEED: u64 = 1337``;
  ``compute_block_hash_for_seq`` uses ``chunks_exact(kv_block_size)`` (partial
  block dropped) and hashes each token's ``u32::to_le_bytes``;
  ``compute_seq_hash_for_block`` sets ``seq[0] = local[0]`` and hashes
  ``[parent_seq, local]`` as two u64 LE with seed 1337
  (``compute_next_sequence_hash`` in ``dynamo_tokens`` uses ``XXH3_SEED``).
* Multimodal: for a block with multimodal objects, their ``mm_hash`` values
  are **sorted** and appended to the block's bytes as u64 LE before hashing.
* LoRA: the adapter name is mixed into the *local* hash seed only:
  ``seed = 1337 + XXH3-64(name utf-8, seed 0)`` (wrapping u64 add;
  ``lib/kv-hashing/src/salt.rs`` ``compute_salt_hash``, which documents
  parity with the router's ``compute_block_hash_for_seq``). An empty name
  counts as no adapter. The chain step keeps seed 1337; the salt reaches
  sequence hashes through the local hashes.

``tests/test_hashing.py`` checks Dynamo's own golden vectors (its tokens
crate test ``test_tokens_blocks``: tokens 1..12, block size 4 give local
hashes 14643705804678351452, 16777012769546811212 and sequence hashes
14643705804678351452, 4945711292740353085, 12583592247330656132), and pins
LoRA and multimodal cases cross-checked by a plain per-token
reimplementation.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence

import xxhash

__all__ = [
    "XXH3_SEED",
    "BlockSizeMismatch",
    "block_seed",
    "tokens_to_bytes",
    "local_block_hash",
    "next_sequence_hash",
    "chain_sequence_hashes",
    "compute_local_block_hashes",
    "compute_block_hashes",
    "ensure_block_size",
]

XXH3_SEED = 1337
"""XXH3 seed of block and chain hashes (Dynamo ``XXH3_SEED``)."""

_U64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - every mainstream platform has 4-byte 'I'
    raise ImportError("kvflow.schemas.block_hash needs a 4-byte array('I')")


class BlockSizeMismatch(ValueError):
    """Hashes made with one block size were compared with another's.

    Block hashes are only comparable at equal ``block_size``: a router indexing
    16-token blocks cannot use a worker's 64-token KV events. Raised by
    :func:`ensure_block_size`.
    """


def ensure_block_size(expected: int, actual: int) -> None:
    """Check that hashes made with ``actual`` block size can join ``expected``'s.

    Raises:
        BlockSizeMismatch: ``actual != expected``.
    """
    if actual != expected:
        raise BlockSizeMismatch(f"block size {actual} does not match expected {expected}")


def block_seed(lora_name: str | None = None) -> int:
    """XXH3 seed for a request's local block hashes.

    1337 without an adapter (or with ``""``); with one,
    ``(1337 + xxh3_64(lora_name.encode(), seed=0)) mod 2**64`` — Dynamo's
    salt, so blocks of different adapters never share a hash.
    """
    if not lora_name:
        return XXH3_SEED
    return (XXH3_SEED + _xxh3(lora_name.encode("utf-8"), 0)) & _U64


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed u32 little-endian bytes (4 bytes per token).

    Accepts a list/tuple of ints or a numpy integer array.

    Raises:
        ValueError: a token id is outside ``[0, 2**32)``.
    """
    if type(token_ids) is not list and hasattr(token_ids, "dtype"):  # numpy array
        import numpy as np

        arr = np.asarray(token_ids)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise ValueError("token ids must fit in u32")
        return arr.astype("<u4", copy=False).tobytes()
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in u32: {exc}") from exc
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def local_block_hash(block_bytes: bytes, seed: int = XXH3_SEED, mm_hashes: Iterable[int] = ()) -> int:
    """Local hash of one block given its u32 LE token bytes.

    ``mm_hashes`` (multimodal content hashes of objects in this block) are
    sorted and appended as u64 LE, as Dynamo does. Returns a u64 int.
    """
    mm = sorted(h & _U64 for h in mm_hashes)
    if mm:
        block_bytes = bytes(block_bytes) + struct.pack(f"<{len(mm)}Q", *mm)
    return _xxh3(block_bytes, seed)


def next_sequence_hash(parent: int | None, local: int) -> int:
    """Chained hash of a block whose prefix ends in sequence hash ``parent``.

    ``parent is None`` (first block) returns ``local`` itself; otherwise
    XXH3-64 of ``parent ‖ local`` as two u64 LE, seed 1337.
    """
    if parent is None:
        return local
    return _xxh3(_pack_pair(parent, local), XXH3_SEED)


def chain_sequence_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes of consecutive blocks following ``parent`` (None = start).

    Returns a list the length of ``local_hashes``.
    """
    out: list[int] = []
    prev = parent
    for local in local_hashes:
        prev = local if prev is None else _xxh3(_pack_pair(prev, local), XXH3_SEED)
        out.append(prev)
    return out


def _mm_by_block(mm_hashes: Iterable[tuple[int, int]] | None, num_blocks: int) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for block_index, mm_hash in mm_hashes or ():
        if block_index < 0:
            raise ValueError(f"negative block index {block_index} in mm_hashes")
        if block_index < num_blocks:  # objects in the partial tail block are not hashed
            groups.setdefault(block_index, []).append(mm_hash)
    return groups


def compute_local_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    mm_hashes: Iterable[tuple[int, int]] | None = None,
) -> list[int]:
    """Local (position-independent) hashes of the full blocks of ``token_ids``.

    Args:
        token_ids: [ISL] token ids, each in ``[0, 2**32)``.
        block_size: tokens per block, >= 1.
        lora_name: adapter name salting the seed (see :func:`block_seed`).
        mm_hashes: ``(block_index, content_hash)`` pairs of multimodal objects;
            a block's hashes are sorted and appended to its bytes.

    Returns:
        ``len(token_ids) // block_size`` u64 ints.

    Raises:
        ValueError: ``block_size < 1`` or a token id outside u32.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    data = tokens_to_bytes(token_ids[: num_blocks * block_size])
    seed = block_seed(lora_name)
    step = block_size * 4
    hashes = [_xxh3(data[i : i + step], seed) for i in range(0, num_blocks * step, step)]
    for block_index, mm in _mm_by_block(mm_hashes, num_blocks).items():
        start = block_index * step
        hashes[block_index] = local_block_hash(data[start : start + step], seed, mm)
    return hashes


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    mm_hashes: Iterable[tuple[int, int]] | None = None,
) -> list[int]:
    """Chained sequence hashes of the full blocks of ``token_ids``.

    The hashes KV events and the KV index use. Arguments as in
    :func:`compute_local_block_hashes`.

    Returns:
        ``len(token_ids) // block_size`` u64 ints; entry ``i`` names blocks
        ``0..i`` together.

    Raises:
        ValueError: ``block_size < 1`` or a token id outside u32.
    """
    return chain_sequence_hashes(compute_local_block_hashes(token_ids, block_size, lora_name, mm_hashes))
