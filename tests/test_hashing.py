"""Block hashing: pinned values, an independent reimplementation, and Dynamo's golden vectors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvflow.schemas.block_hash import (
    XXH3_SEED,
    BlockSizeMismatch,
    block_seed,
    chain_sequence_hashes,
    compute_block_hashes,
    compute_local_block_hashes,
    ensure_block_size,
)

TOKENS = list(range(1, 19))  # 18 tokens: four blocks of 4 and a partial block of 2

# Pinned outputs of this implementation (block_size 4).
PLAIN_LOCAL = [14643705804678351452, 16777012769546811212, 483935686894639516, 135165725823939817]
PLAIN_SEQ = [14643705804678351452, 4945711292740353085, 12583592247330656132, 1921452330601040443]
LORA_SEQ = [2770223091991657874, 24975635027445590, 10700444442481908946, 13698067503570783682]
MM_SEQ = [14643705804678351452, 17985281199665614201, 3163852332821133910, 18115816960304969541]


def reference_hashes(tokens, block_size, lora_name=None, mm=None):
    """Straightforward per-token reimplementation of the published scheme."""
    seed = 1337
    if lora_name:
        seed = (1337 + xxhash.xxh3_64(lora_name.encode("utf-8"), seed=0).intdigest()) % 2**64
    seq, parent = [], None
    for b in range(len(tokens) // block_size):
        data = b"".join(struct.pack("<I", t) for t in tokens[b * block_size : (b + 1) * block_size])
        for h in sorted((mm or {}).get(b, [])):
            data += struct.pack("<Q", h)
        local = xxhash.xxh3_64(data, seed=seed).intdigest()
        if parent is None:
            parent = local
        else:
            parent = xxhash.xxh3_64(struct.pack("<Q", parent) + struct.pack("<Q", local), seed=1337).intdigest()
        seq.append(parent)
    return seq


def test_dynamo_golden_vectors():
    # Dynamo's tokens-crate test `test_tokens_blocks`: tokens 1..10, block size 4, seed 1337.
    assert compute_local_block_hashes(list(range(1, 11)), 4) == [14643705804678351452, 16777012769546811212]
    assert compute_block_hashes(list(range(1, 13)), 4) == [
        14643705804678351452,
        4945711292740353085,
        12583592247330656132,
    ]


def test_plain_hashes_pinned_and_match_reference():
    assert compute_local_block_hashes(TOKENS, 4) == PLAIN_LOCAL
    assert compute_block_hashes(TOKENS, 4) == PLAIN_SEQ
    assert reference_hashes(TOKENS, 4) == PLAIN_SEQ
    assert PLAIN_SEQ[0] == PLAIN_LOCAL[0]  # the first block's sequence hash is its local hash


def test_partial_last_block_is_ignored():
    assert compute_block_hashes(TOKENS[:16], 4) == PLAIN_SEQ
    assert compute_block_hashes(TOKENS[:15], 4) == PLAIN_SEQ[:3]
    assert compute_block_hashes(TOKENS[:3], 4) == []
    assert len(compute_block_hashes(list(range(1000)), 64)) == 1000 // 64


def test_lora_salt_pinned_and_match_reference():
    assert block_seed("sql-adapter") == (1337 + xxhash.xxh3_64_intdigest(b"sql-adapter", 0)) % 2**64
    assert compute_block_hashes(TOKENS, 4, lora_name="sql-adapter") == LORA_SEQ
    assert reference_hashes(TOKENS, 4, lora_name="sql-adapter") == LORA_SEQ
    assert set(LORA_SEQ).isdisjoint(PLAIN_SEQ)
    assert compute_block_hashes(TOKENS, 4, lora_name="other") != LORA_SEQ
    assert compute_block_hashes(TOKENS, 4, lora_name="") == PLAIN_SEQ  # empty name = no adapter
    assert block_seed(None) == XXH3_SEED


def test_mm_salt_pinned_and_match_reference():
    mm = [(1, 0xDEADBEEF), (1, 42)]
    assert compute_block_hashes(TOKENS, 4, mm_hashes=mm) == MM_SEQ
    assert reference_hashes(TOKENS, 4, mm={1: [0xDEADBEEF, 42]}) == MM_SEQ
    # Block 0 is untouched; from block 1 on every chained hash changes.
    assert MM_SEQ[0] == PLAIN_SEQ[0]
    assert all(a != b for a, b in zip(MM_SEQ[1:], PLAIN_SEQ[1:], strict=True))
    # Order of objects within a block does not matter (sorted), objects in the partial block are ignored.
    assert compute_block_hashes(TOKENS, 4, mm_hashes=[(1, 42), (1, 0xDEADBEEF), (4, 7)]) == MM_SEQ


def test_chain_continues_from_parent():
    local = compute_local_block_hashes(TOKENS, 4)
    assert chain_sequence_hashes(local[2:], parent=PLAIN_SEQ[1]) == PLAIN_SEQ[2:]


def test_numpy_input_matches_list():
    assert compute_block_hashes(np.array(TOKENS, dtype=np.int64), 4) == PLAIN_SEQ
    assert compute_block_hashes(np.array(TOKENS, dtype=np.uint32), 4) == PLAIN_SEQ


def test_large_token_ids_and_errors():
    big = [2**32 - 1, 0, 123456, 7] * 3
    assert compute_block_hashes(big, 4) == reference_hashes(big, 4)
    with pytest.raises(ValueError):
        compute_block_hashes([1, 2, -1, 4], 4)
    with pytest.raises(ValueError):
        compute_block_hashes([1, 2, 2**32, 4], 4)
    with pytest.raises(ValueError):
        compute_block_hashes(np.array([1, 2, -1, 4]), 4)
    with pytest.raises(ValueError):
        compute_block_hashes(TOKENS, 0)


def test_block_size_mismatch():
    ensure_block_size(64, 64)
    with pytest.raises(BlockSizeMismatch) as info:
        ensure_block_size(64, 16)
    assert isinstance(info.value, ValueError)


def test_long_prompt_matches_reference():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=1000).tolist()
    assert compute_block_hashes(tokens, 64, lora_name="a") == reference_hashes(tokens, 64, lora_name="a")
