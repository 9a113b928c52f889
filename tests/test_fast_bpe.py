"""tiktoken encodes exactly as Hugging Face tokenizers where kvflow lets it, and nowhere else."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvflow.models.fast_bpe import FAST_BPE_ENV, FastBpe, fast_bpe
from kvflow.models.tokenizer import HfTokenizer, load_tokenizer

pytest.importorskip("tiktoken")

MTBENCH = Path(__file__).resolve().parents[1] / "examples" / "traces" / "mtbench_question.jsonl"

# Characters from the classes the GPT-2 regex tells apart, scripts of several widths, marks,
# emoji with modifiers, whitespace of every kind, added tokens written in text.
ALPHABET = (list("abcXYZ019 '.,;:!?-_()[]{}<>\"/\\|@#$%^&*+=~`") + [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0",
            "\u2003", "é", "ß", "ǅ", "ª", "e\u0301", "日", "本", "語", "П", "р", "и", "م", "ر", "ह", "ि", "😀", "👍🏽",
            "🇯🇵", "𝔘", "²", "½", "٣", "'s", "'ll", "'VE", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00",
            "\x7f"])
NO_SYMBOL = ["\x04", "\x13", "\U00050000"]
"""Characters SmolLM2's vocabulary has no byte symbol for: texts holding them go to tokenizers."""


@pytest.fixture(scope="module")
def smollm2() -> HfTokenizer:
    tok = load_tokenizer("SmolLM2-135M-Instruct")
    assert isinstance(tok, HfTokenizer)
    tok.warm()
    return tok


def _hf(tok: HfTokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok._backend.encode_batch_fast(texts, add_special_tokens=False)]


def test_smollm2_is_encoded_by_tiktoken(smollm2):
    assert isinstance(smollm2._fast, FastBpe)
    assert smollm2._fast.unfit_ascii  # SmolLM2 lacks some control bytes: those texts go to tokenizers


def test_every_vocabulary_entry_encodes_alike(smollm2):
    spec = json.loads(smollm2._backend.to_str())
    decode = smollm2._backend.decode
    texts = [decode([i], skip_special_tokens=False) for i in spec["model"]["vocab"].values()]
    texts = [t for t in texts if "\ufffd" not in t]  # partial UTF-8 sequences are not text
    assert len(texts) > 40_000
    got = [smollm2._fast.encode(t) for t in texts]
    want = _hf(smollm2, texts)
    assert [g for g, w in zip(got, want) if g is not None and g != w] == []


def test_random_texts_encode_alike(smollm2):
    rng = random.Random(11)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 400))) for _ in range(3000)]
    texts = [t if i % 4 else t[:len(t) // 2] + rng.choice(NO_SYMBOL) + t[len(t) // 2:] for i, t in enumerate(texts)]
    fast = [smollm2._fast.encode(t) for t in texts]
    assert [i for i, f in enumerate(fast) if f is None] == list(range(0, 3000, 4))
    assert [smollm2.encode_prompt(t) for t in texts] == _hf(smollm2, texts)


def test_long_prompts_and_chats_encode_alike(smollm2):
    questions = [turn for line in MTBENCH.read_text().splitlines() for turn in json.loads(line)["turns"]]
    rng = random.Random(5)
    long_text = " ".join(rng.choice(questions) for _ in range(600))  # ~60k tokens, cut into cached chunks
    assert smollm2.encode_prompt(long_text) == _hf(smollm2, [long_text])[0]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": long_text[:40_000]},
            {"role": "assistant", "content": "Noted.\n\n  Next?"}, {"role": "user", "content": questions[7]}]
    assert smollm2.encode_chat(chat) == _hf(smollm2, [smollm2._render_chat(chat)])[0]
    # The same prompt again, with its chunks cached, and with one character no byte symbol covers.
    assert smollm2.encode_prompt(long_text) == _hf(smollm2, [long_text])[0]
    odd = long_text[:30_000] + "\x13" + long_text[30_000:]
    assert smollm2.encode_prompt(odd) == _hf(smollm2, [odd])[0]


# The split regexes of Llama 3's and Qwen 2's tokenizer.json (their pre-tokenizer: Split on it, then
# ByteLevel without its own regex), applied here to SmolLM2's vocabulary and merges.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str, normalizer: dict | None = None):
    def change(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        spec["normalizer"] = normalizer
    return change


@pytest.mark.parametrize("regex, normalizer", [(LLAMA3_SPLIT, None), (QWEN2_SPLIT, {"type": "NFC"})],
                         ids=["llama3-split", "qwen2-split-nfc"])
def test_split_regex_tokenizers_encode_alike(smollm2, regex, normalizer):
    variant = _variant(smollm2, _split_then_bytes(regex, normalizer))
    fast = fast_bpe(variant)
    assert fast is not None and fast.check_bytes and fast.nfc == (normalizer is not None)
    rng = random.Random(13)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 400))) for _ in range(2000)]
    questions = [turn for line in MTBENCH.read_text().splitlines() for turn in json.loads(line)["turns"]]
    texts.append(" ".join(rng.choice(questions) for _ in range(300)))
    want = [e.ids for e in variant.encode_batch_fast(texts, add_special_tokens=False)]
    got = [fast.encode(t) for t in texts]
    assert [i for i, (g, w) in enumerate(zip(got, want)) if g is not None and g != w] == []
    left = [t for t, g in zip(texts, got) if g is None]  # not in NFC (decomposed é): tokenizers encodes them
    if normalizer is None:
        assert left == []
    else:
        assert left and all("e\u0301" in t for t in left)
    assert len(want[-1]) > 10_000


def _variant(tok: HfTokenizer, change) -> Tokenizer:
    spec = json.loads(tok._backend.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def _swap_two_merges(spec):
    merges = spec["model"]["merges"]
    merges[100], merges[101] = merges[101], merges[100]


def _lowercase(spec):
    spec["normalizer"] = {"type": "Lowercase"}


def _prefix_space(spec):
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _nested_added_tokens(spec):
    spec["added_tokens"].append({**spec["added_tokens"][1], "id": len(spec["model"]["vocab"]) + 5,
                                 "content": spec["added_tokens"][1]["content"] + "x"})


def _gaps_split(spec):
    _split_then_bytes(r"\p{L}+")(spec)  # a regex that leaves digits, spaces and marks out of every piece


@pytest.mark.parametrize("change", [_swap_two_merges, _lowercase, _prefix_space, _nested_added_tokens, _gaps_split])
def test_tokenizers_tiktoken_would_encode_differently_are_left_to_tokenizers(smollm2, change):
    assert fast_bpe(_variant(smollm2, change)) is None


def test_the_environment_switch_turns_it_off(smollm2, monkeypatch):
    assert fast_bpe(smollm2._backend) is not None
    monkeypatch.setenv(FAST_BPE_ENV, "0")
    assert fast_bpe(smollm2._backend) is None
