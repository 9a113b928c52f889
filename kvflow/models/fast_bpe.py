"""Byte-level BPE encoding with ``tiktoken``, for tokenizers it encodes exactly.

Tokenizing prompts is the bridge's largest cost on long prompts: Hugging
Face ``tokenizers`` spends 2.3–3.0 µs of CPU per token on SmolLM2's
tokenizer on this project's 2-core test machine (most of it building the
offsets and alignments of its ``Encoding``, which the bridge drops), and on
the Mooncake slice a burst of prompts queued ~0.2–0.7 s for it
(docs/benchmarks.md, "Tokenizing with tiktoken"). OpenAI's ``tiktoken``
runs the same byte-level BPE in ~0.6 µs per token.

The two agree token for token when the tokenizer is GPT-2-style byte-level
BPE (Radford et al. 2019, ``encoder.py``): both split the text with the same
regex, then merge adjacent symbols greedily, lowest rank first, leftmost on
ties. ``tokenizers`` ranks a pair by its line in the merges list; ``tiktoken``
ranks it by the id of the merged token, and first looks a whole regex piece up
in the vocabulary. :func:`fast_bpe` builds an encoding only when those
coincide, checked on the tokenizer itself:

* the model is BPE without dropout or word prefixes/suffixes; no
  normalizer but NFC (Qwen 2's), applied by leaving every text that is not
  already NFC to ``tokenizers``; the pre-tokenizer is ``ByteLevel`` with
  the GPT-2 regex and no prefix space, or one ``Split`` on a regex (its
  matches and the text between them as pieces) followed by ``ByteLevel``
  without its regex, the form of Llama 3's and Qwen 2's tokenizers;
* the merged tokens' ids increase with the merges' order and no two merges
  make the same token, so both rank orders are one order;
* every token of the vocabulary encodes to itself under the tokenizer's own
  BPE (what ``tiktoken``'s whole-piece lookup assumes);
* added tokens match as ``tokenizers`` matches them: none is a prefix of
  another (``tiktoken`` takes the first alternative, ``tokenizers`` the
  longest), none is single-word or strips the spaces beside it;
* both encode :data:`PROBE_TEXT` (several scripts, digits, whitespace runs,
  added tokens) to the same ids.

A tokenizer that fails any check is encoded by ``tokenizers`` as before.
``tiktoken`` keeps only the regex's matches, so with a ``Split`` regex, which
may leave text between its matches, an encoding that does not hold every
byte of the text is dropped for ``tokenizers``' (GPT-2's regex matches
every character).
Vocabularies may lack the symbols of some bytes (SmolLM2's lacks six control
characters, the lead bytes of planes 4–11 and the bytes UTF-8 never uses),
which ``tokenizers`` encodes as its unknown token: a text holding a character
made of such a byte is encoded by ``tokenizers`` (:meth:`FastBpe.encode`
returns None for it).
The test suite also compares the two on every vocabulary entry and on long
mixed and fuzzed texts (tests/test_fast_bpe.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

__all__ = ["GPT2_PATTERN", "PROBE_TEXT", "FAST_BPE_ENV", "FastBpe", "fast_bpe"]

log = logging.getLogger(__name__)

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The pre-tokenizer regex of GPT-2 (``encoder.py``), which ``tokenizers``'
``ByteLevel(use_regex=True)`` applies."""

FAST_BPE_ENV = "KVFLOW_FAST_BPE"
"""Set to ``0`` to encode with ``tokenizers`` even where ``tiktoken`` would agree."""

PROBE_TEXT = (
    "Hello world! It's 2026-11-30, the temperature's 21.5°C.\n\n\tIndented   spaces   \n"
    "naïve café — «quotes» and ‘curly’ ones; 東京都の天気は晴れ。 Привет, мир! مرحبا بالعالم "
    "नमस्ते 🙂👍🏽 x²+y²=z² 1234567890 0x1F 3.14159 ...!!! ??? ''' \"\"\" ``` <<< >>> "
    "   \n\n\n   trailing\r\nwindows line\u00a0nbsp\u2003em space I'll you've we'd they're "
    "CamelCaseWord snake_case_word kebab-case-word https://example.com/a?b=c&d=e#f "
)
"""Text both encoders must agree on before the fast one is used (added tokens
are appended to it at check time)."""


def _enabled() -> bool:
    return os.environ.get(FAST_BPE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _byte_symbols() -> dict[str, int]:
    """The byte-level alphabet: symbol → byte value (GPT-2's byte ↔ unicode map)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {symbol: byte for byte, symbol in bytes_to_unicode().items()}


def _split_pattern(spec: dict[str, Any]) -> tuple[str, None] | tuple[None, str]:
    """(the regex that cuts the text into pieces, None), or (None, why there
    is none) for a pre-tokenizer other than the two forms of the module docstring."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PATTERN, None
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        split, level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if isinstance(regex, str) and split.get("behavior") == "Isolated" and not split.get("invert") \
                and not level.get("use_regex", True) and not level.get("add_prefix_space"):
            return regex, None
    return None, "its pre-tokenizer is neither ByteLevel with the GPT-2 regex nor a regex Split then ByteLevel"


def _normalizer(spec: dict[str, Any]) -> str | None:
    """``""`` (none), ``"NFC"``, or None for any other normalizer."""
    norm = spec.get("normalizer")
    steps = (norm.get("normalizers") or []) if norm is not None and norm.get("type") == "Sequence" else [norm]
    kinds = [step.get("type") for step in steps if step is not None]
    if not kinds:
        return ""
    return "NFC" if kinds == ["NFC"] else None


def _why_not(spec: dict[str, Any]) -> str | None:
    """Why the normalizer, model or added tokens of a tokenizer described by
    ``spec`` (its ``tokenizer.json``) rule ``tiktoken`` out; None when they do not."""
    if _normalizer(spec) is None:
        return "it has a normalizer other than NFC"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        return "its model is not plain BPE"
    contents = [str(tok.get("content", "")) for tok in spec.get("added_tokens") or ()]
    if any(tok.get("single_word") or tok.get("lstrip") or tok.get("rstrip") for tok in spec.get("added_tokens") or ()):
        return "an added token is single-word or strips spaces"
    if any(a != b and b.startswith(a) for a in contents for b in contents) or "" in contents:
        return "an added token is a prefix of another"
    return None


@dataclass(frozen=True)
class FastBpe:
    """A ``tiktoken`` encoding equal to a ``tokenizers`` one (see :func:`fast_bpe`)."""

    encoding: Any
    """The ``tiktoken.Encoding``; every added token of the tokenizer is one of its special tokens."""
    unfit_ascii: tuple[str, ...] = ()
    """ASCII characters whose byte has no symbol in the vocabulary."""
    unfit_wide: re.Pattern[str] | None = None
    """Matches the other characters (past U+007F) holding a byte without a symbol."""
    check_bytes: bool = False
    """Check that the ids hold every byte of the text (a split regex that may skip text)."""
    nfc: bool = False
    """The tokenizer normalizes to NFC: only texts already in NFC are encoded here."""

    def encode(self, text: str) -> list[int] | None:
        """Ids of ``text`` (shape [tokens]) as the tokenizer's
        ``encode(text, add_special_tokens=False)`` gives them; None when
        ``text`` holds a character without byte symbols (encode it with the
        tokenizer)."""
        # `in` is a memchr per character, and isascii() reads a flag: ~0.1 ms for 500 KB of
        # ASCII, where one regex over the text took 5.
        if any(ch in text for ch in self.unfit_ascii) or (
                self.unfit_wide is not None and not text.isascii() and self.unfit_wide.search(text)) or (
                self.nfc and not text.isascii() and not unicodedata.is_normalized("NFC", text)):
            return None
        ids = self.encoding.encode(text, allowed_special="all")
        if self.check_bytes and len(self.encoding.decode_bytes(ids)) != len(text.encode("utf-8", "surrogatepass")):
            return None
        return ids


def fast_bpe(backend: Any) -> FastBpe | None:
    """A :class:`FastBpe` that encodes exactly as the ``tokenizers.Tokenizer``
    ``backend`` does with ``add_special_tokens=False`` (every added token of
    ``backend`` recognized in the text, as ``backend`` recognizes them), or None
    when the checks in the module docstring fail, ``tiktoken`` is not
    installed, or :data:`FAST_BPE_ENV` is ``0``.

    Building takes 0.7–1.0 s of CPU for a 49k-token vocabulary (the self-encoding
    check of every token), once per process and tokenizer. Never raises: a
    failure is logged and gives None.
    """
    if not _enabled():
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    try:
        spec = json.loads(backend.to_str())
        pattern, why = _split_pattern(spec)
        why = why or _why_not(spec) or _order_mismatch(spec["model"])
        if why is None:
            fast = FastBpe(_build(tiktoken, spec, pattern), *_unfit(spec["model"]["vocab"]),
                           check_bytes=pattern != GPT2_PATTERN, nfc=_normalizer(spec) == "NFC")
            why = _self_mismatch(backend, spec) or _probe_mismatch(backend, fast, spec)
    except Exception as exc:  # noqa: BLE001 - any surprise means: use tokenizers
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        log.info("tokenizer encoded by tokenizers, not tiktoken: %s", why)
        return None
    log.info("tokenizer encoded by tiktoken (exact: merge order, vocabulary and probe text checked)")
    return fast


def _merges(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or ()]


def _order_mismatch(model: dict[str, Any]) -> str | None:
    """Why merge order and merged-token ids are not one order; None when they are."""
    vocab: dict[str, int] = model["vocab"]
    if any(0x80 <= byte <= 0xBF for symbol, byte in _byte_symbols().items() if symbol not in vocab):
        return "a UTF-8 continuation byte has no symbol in the vocabulary"
    made = [a + b for a, b in _merges(model)]
    if len(set(made)) != len(made):
        return "two merges make the same token"
    if any(m not in vocab for m in made):
        return "a merge makes a token outside the vocabulary"
    ids = [vocab[m] for m in made]
    if any(later <= earlier for earlier, later in zip(ids, ids[1:])):
        return "merged tokens' ids do not increase with the merges' order"
    return None


_LEAD_RANGES = {**{b: ((b - 0xC0) << 6, ((b - 0xC0) << 6) | 0x3F) for b in range(0xC2, 0xE0)},
                **{b: (max((b - 0xE0) << 12, 0x800), ((b - 0xE0) << 12) | 0xFFF) for b in range(0xE0, 0xF0)},
                **{b: (max((b - 0xF0) << 18, 0x10000), min(((b - 0xF0) << 18) | 0x3FFFF, 0x10FFFF))
                   for b in range(0xF0, 0xF5)}}
"""UTF-8 lead byte → (first, last) code point of the characters it starts
(RFC 3629, section 3); 0xC0, 0xC1 and 0xF5–0xFF start none."""


def _unfit(vocab: dict[str, int]) -> tuple[tuple[str, ...], re.Pattern[str] | None]:
    """The characters holding a byte (ASCII or UTF-8 lead byte) that has no
    symbol in ``vocab``: the ASCII ones, and a character class of the others
    (None if none). Continuation bytes are required by :func:`_order_mismatch`."""
    ascii_chars: list[str] = []
    ranges: list[str] = []
    for symbol, byte in sorted(_byte_symbols().items(), key=lambda item: item[1]):
        if symbol in vocab:
            continue
        if byte < 0x80:
            ascii_chars.append(chr(byte))
        elif byte in _LEAD_RANGES:
            first, last = _LEAD_RANGES[byte]
            ranges.append(f"{re.escape(chr(first))}-{re.escape(chr(last))}")
    return tuple(ascii_chars), (re.compile(f"[{''.join(ranges)}]") if ranges else None)


def _build(tiktoken: Any, spec: dict[str, Any], pattern: str) -> Any:
    symbols = _byte_symbols()
    added = {str(tok["content"]): int(tok["id"]) for tok in spec.get("added_tokens") or ()}
    ranks: dict[bytes, int] = {}
    for token, token_id in spec["model"]["vocab"].items():
        if token in added:
            continue
        ranks[bytes(symbols[ch] for ch in token)] = token_id  # KeyError: not byte-level; caller logs it
    return tiktoken.Encoding(name="kvflow-byte-bpe", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=added)


def _self_mismatch(backend: Any, spec: dict[str, Any]) -> str | None:
    """The first vocabulary token the tokenizer's BPE does not encode to
    itself (as a message); None when each does."""
    model = backend.model
    added = {str(tok["content"]) for tok in spec.get("added_tokens") or ()}
    for token, token_id in spec["model"]["vocab"].items():
        if token in added:
            continue
        got = [t.id for t in model.tokenize(token)]
        if got != [token_id]:
            return f"token {token!r} (id {token_id}) encodes to {got} under the tokenizer's BPE"
    return None


def _probe_mismatch(backend: Any, fast: FastBpe, spec: dict[str, Any]) -> str | None:
    text = PROBE_TEXT + " ".join(str(tok["content"]) for tok in spec.get("added_tokens") or ()) + PROBE_TEXT
    want = backend.encode(text, add_special_tokens=False).ids
    got = fast.encode(text)
    if got is None:
        return "the probe text holds a character without byte symbols"
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return f"tiktoken and tokenizers disagree on the probe text at token {at}"
    return None
