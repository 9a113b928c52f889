"""Chunked, cached prompt encoding gives exactly the ids of encoding the whole text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from kvflow.models.chunked_encode import ChunkCache, chunkable, safe_cuts
from kvflow.models.tokenizer import HfTokenizer, load_tokenizer
from kvflow.schemas import ChatMessage

MTBENCH = Path(__file__).resolve().parents[1] / "examples" / "traces" / "mtbench_question.jsonl"

# Pieces that stress the GPT-2 pre-tokenizer regex around spaces: contractions, digits, runs of
# spaces and newlines, non-Latin letters, combining marks, emoji, special tokens written in text.
PIECES = ["the", "cat", "don't", "it's", "we'll", "I'm", "42", "3.14", "x1", "--", "!?", "\n", "\n\n", "  ", "\t",
          "é", "naïve", "e\u0301", "日本語", "Привет", "مرحبا", "😀", "👍🏽", "<|im_end|>", "<|im_start|>", "'s",
          " ", "a", "Z", "ß", "ǅ", "ª", "(", ")", "\"quoted\"", "http://x.y/z?q=1"]


def _random_text(rng: random.Random, n: int) -> str:
    parts = []
    for _ in range(n):
        parts.append(rng.choice(PIECES))
        parts.append(rng.choice([" ", " ", " ", "", "\n", "  "]))
    return "".join(parts)


@pytest.fixture(scope="module")
def smollm2() -> HfTokenizer:
    tok = load_tokenizer("SmolLM2-135M-Instruct")
    assert isinstance(tok, HfTokenizer)
    return tok


def _whole(tok: HfTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return tok._backend.encode(text, add_special_tokens=add_special_tokens).ids


def test_safe_cuts_sit_on_spaces_between_letters_and_respect_the_spacing():
    text = "alpha beta  gamma delta.epsilon zeta eta"
    cuts = safe_cuts(text, every=4)
    assert cuts == [5, 17, 31, 36]  # " beta", " delta.epsilon", " zeta", " eta": never inside "  gamma"
    assert all(text[p] == " " and text[p - 1].isalpha() and text[p + 1].isalpha() for p in cuts)
    assert safe_cuts("short text", every=2048) == []
    assert safe_cuts("ends with a space ", every=1) == [4, 9, 11]  # never the last character


def test_cuts_inside_a_shared_prefix_are_shared():
    rng = random.Random(3)
    prefix = _random_text(rng, 3000)
    a, b = prefix + " first ending", prefix + " another question entirely"
    inside = [p for p in safe_cuts(a, 256) if p + 1 < len(prefix)]
    assert len(inside) > 10
    assert inside == [p for p in safe_cuts(b, 256) if p + 1 < len(prefix)]


@pytest.mark.parametrize("seed", range(12))
def test_chunked_ids_equal_whole_ids_on_adversarial_text(smollm2, seed):
    rng = random.Random(seed)
    text = _random_text(rng, 1500)
    cache = ChunkCache(every=rng.choice([8, 32, 200]))
    ids = cache.encode(text, smollm2._encode_batch)
    assert cache.miss_chars == len(text)
    assert ids == _whole(smollm2, text)


def test_chunked_ids_equal_whole_ids_on_real_chat_prompts(smollm2):
    rows = [json.loads(line) for line in MTBENCH.read_text().splitlines() if line.strip()]
    cache = smollm2.chunk_cache
    assert cache is not None
    hits, misses = cache.hit_chars, cache.miss_chars  # the tokenizer is shared with other tests
    history: list[ChatMessage] = [ChatMessage(role="system", content="You are a helpful assistant.")]
    for row in rows:  # one long conversation: every turn resends all the turns before it
        for turn in row["turns"]:
            history.append(ChatMessage(role="user", content=turn))
            ids = smollm2.encode_chat(history)
            assert ids == _whole(smollm2, smollm2._render_chat(history))
            history.append(ChatMessage(role="assistant", content=turn[::-1]))
    assert len(ids) > 8000
    assert cache.hit_chars - hits > 10 * (cache.miss_chars - misses)  # the resent history came from the cache


def test_a_shared_prefix_is_encoded_once(smollm2):
    rng = random.Random(11)
    prefix = _random_text(rng, 4000)
    cache = ChunkCache(every=512)
    first = cache.encode(prefix + " tell me more", smollm2._encode_batch)
    missed = cache.miss_chars
    second = cache.encode(prefix + " now summarize", smollm2._encode_batch)
    assert first == _whole(smollm2, prefix + " tell me more")
    assert second == _whole(smollm2, prefix + " now summarize")
    assert cache.hit_chars > 0.9 * len(prefix)
    assert cache.miss_chars - missed < 0.1 * len(prefix)


def test_encode_prompt_with_special_tokens_matches_the_tokenizer(smollm2):
    text = _random_text(random.Random(5), 3000)
    assert smollm2.encode_prompt(text) == _whole(smollm2, text, add_special_tokens=True)


def test_the_cache_stays_within_its_bound_and_evicts_the_oldest(smollm2):
    cache = ChunkCache(max_chars=4000, every=200)
    texts = [_random_text(random.Random(100 + i), 300) for i in range(6)]
    for text in texts:
        assert cache.encode(text, smollm2._encode_batch) == _whole(smollm2, text)
        assert cache._chars <= 4000
    hits = cache.hit_chars
    cache.encode(texts[-1], smollm2._encode_batch)  # the newest text is still cached
    assert cache.hit_chars - hits > 0.9 * len(texts[-1])
    hits = cache.hit_chars
    cache.encode(texts[0], smollm2._encode_batch)  # the oldest was evicted
    assert cache.hit_chars == hits


def test_a_failed_encode_caches_nothing():
    cache = ChunkCache(every=4)

    def broken(chunks):
        raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="tokenizer failed"):
        cache.encode("some words to cut here", broken)
    assert cache._chars == 0 and not cache._entries


def test_only_byte_level_bpe_without_normalizer_is_chunked(smollm2):
    assert chunkable(smollm2._backend)
    wordlevel = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    assert not chunkable(wordlevel)
    prefixed = Tokenizer(models.BPE())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not chunkable(prefixed)
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert chunkable(plain)
    plain.add_special_tokens([AddedToken("<sep>", rstrip=True)])  # would eat the space a cut starts with
    assert not chunkable(plain)
