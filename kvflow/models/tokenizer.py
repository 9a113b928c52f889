"""Tokenizers behind one small interface, and incremental detokenization.

:func:`load_tokenizer` returns either an :class:`HfTokenizer` (a model's own
tokenizer and chat template, loaded from its local directory) or a
:class:`ByteTokenizer` (token id = UTF-8 byte + a small offset; used by the
mocker engine and for models that ship no tokenizer). Both offer
``encode_chat``, ``encode_prompt``, ``decode``, ``eos_token_ids``, ``name``
and ``vocab_size``. :class:`IncrementalDetokenizer` turns a growing list of
token ids into text deltas for streaming.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvflow.schemas import ChatMessage
from kvflow.models.chunked_encode import ChunkCache, chunkable
from kvflow.models.fast_bpe import fast_bpe
from kvflow.models.resolve import resolve_model

__all__ = ["Tokenizer", "ByteTokenizer", "HfTokenizer", "IncrementalDetokenizer", "load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    """What kvflow needs from a tokenizer (both implementations satisfy it)."""

    name: str
    vocab_size: int
    eos_token_ids: set[int]

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of a chat rendered with a generation prompt for the assistant."""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain text prompt."""

    def encode_chat_parts(self, messages: Sequence[ChatMessage], marker: str) -> list[list[int]]:
        """Token ids of a chat as :meth:`encode_chat`, split where ``marker``
        stands in the message text (the marker itself dropped): one list
        more than the marker occurs."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped."""

    def warm(self) -> None:
        """Prepare encoding now rather than on the first prompt."""


def _role_and_content(message: ChatMessage | dict) -> tuple[str, str]:
    if isinstance(message, dict):
        return str(message["role"]), str(message.get("content") or "")
    return message.role, message.content


class ByteTokenizer:
    """A tokenizer without a vocabulary file: one token per UTF-8 byte.

    Token id = byte value + :attr:`NUM_SPECIAL` (so ids 4..259 are bytes);
    ids 0..3 are specials: ``PAD``, ``BOS``, ``EOS`` and ``EOT`` (end of
    turn). ``vocab_size`` is 260. Chat format (fixed)::

        BOS  "<|role|>\\n" content EOT  ...  "<|assistant|>\\n"

    ``eos_token_ids`` is ``{EOS, EOT}``. Decoding skips specials and replaces
    invalid UTF-8 with U+FFFD.
    """

    PAD, BOS, EOS, EOT = 0, 1, 2, 3
    NUM_SPECIAL = 4
    vocab_size = 256 + NUM_SPECIAL

    def __init__(self, name: str = "bytes") -> None:
        self.name = name
        self.eos_token_ids = {self.EOS, self.EOT}

    def _bytes(self, text: str) -> list[int]:
        return [b + self.NUM_SPECIAL for b in text.encode("utf-8")]

    def warm(self) -> None:
        """Nothing to prepare."""

    def encode_prompt(self, text: str) -> list[int]:
        """Byte ids of ``text`` (no BOS), length = UTF-8 byte count."""
        return self._bytes(text)

    def encode_chat(self, messages: Sequence[ChatMessage | dict]) -> list[int]:
        """Ids of the fixed chat format above, ending with the assistant header."""
        ids = [self.BOS]
        for message in messages:
            role, content = _role_and_content(message)
            ids += self._bytes(f"<|{role}|>\n{content}")
            ids.append(self.EOT)
        return ids + self._bytes("<|assistant|>\n")

    def encode_chat_parts(self, messages: Sequence[ChatMessage | dict], marker: str) -> list[list[int]]:
        """:meth:`encode_chat` split where ``marker`` stands in a message's text
        (marker bytes dropped); ``len(result)`` = occurrences + 1."""
        parts: list[list[int]] = [[self.BOS]]
        for message in messages:
            role, content = _role_and_content(message)
            pieces = f"<|{role}|>\n{content}".split(marker)
            parts[-1] += self._bytes(pieces[0])
            for piece in pieces[1:]:
                parts.append(self._bytes(piece))
            parts[-1].append(self.EOT)
        parts[-1] += self._bytes("<|assistant|>\n")
        return parts

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of the byte ids in ``token_ids``; specials and ids >= 260 are skipped."""
        data = bytes(t - self.NUM_SPECIAL for t in token_ids if self.NUM_SPECIAL <= t < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HfTokenizer:
    """A Hugging Face tokenizer loaded from a local model directory.

    ``encode_chat`` renders the tokenizer's chat template with
    ``add_generation_prompt=True`` and encodes the text without adding special
    tokens again (the template already has them). A tokenizer without a chat
    template falls back to ``"role: content\\n"`` lines ending in
    ``"assistant:"``. ``eos_token_ids`` is the union of the tokenizer's EOS id
    and the ``eos_token_id`` entries of ``config.json`` and
    ``generation_config.json``.
    """

    def __init__(self, path: Path, name: str) -> None:
        from transformers import AutoTokenizer

        self.name = name
        self.path = Path(path)
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.vocab_size = len(self._tok)
        self.eos_token_ids = self._eos_ids()
        self._backend = self._rust_backend()
        self.chunk_cache = ChunkCache() if self._backend is not None and hasattr(self._backend, "encode_batch_fast") \
            and chunkable(self._backend) else None
        self._bare_specials = self._backend is not None and self._adds_no_specials()
        self._fast: Any = None
        self._fast_checked = False
        self._fast_lock = threading.Lock()

    def warm(self) -> None:
        """Build what encoding needs (the ``tiktoken`` encoding, 0.7–1.0 s of CPU) now
        rather than on the first prompt."""
        self._fast_encoding()

    def _fast_encoding(self) -> Any:
        """The :class:`~kvflow.models.fast_bpe.FastBpe` equal to the backend, or None."""
        if not self._fast_checked:
            with self._fast_lock:
                if not self._fast_checked:
                    self._fast = fast_bpe(self._backend) if self._backend is not None else None
                    self._fast_checked = True
        return self._fast

    def _rust_backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` behind a fast tokenizer, when calling it
        directly gives what transformers' ``encode``/``decode`` give (no
        clean-up of tokenization spaces, no split of special tokens); else None.

        transformers (v5) wraps that one Rust call in Python conversions that
        cost about a fifth of the encode time of a long prompt (offsets are
        computed and dropped) and most of the decode time of the few tokens the
        incremental detokenizer decodes per engine output, on the bridge's and
        the worker's event loops.
        """
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
            return None
        backend = getattr(self._tok, "_tokenizer", None)
        if not isinstance(backend, RustTokenizer) or getattr(self._tok, "clean_up_tokenization_spaces", False) \
                or getattr(self._tok, "split_special_tokens", False) or backend.encode_special_tokens:
            return None
        return backend

    def _adds_no_specials(self) -> bool:
        """True when ``add_special_tokens=True`` adds nothing (SmolLM2 adds no BOS)."""
        probe = "Hello world"
        return self._backend.encode(probe, add_special_tokens=True).ids == \
            self._backend.encode(probe, add_special_tokens=False).ids

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        fast = self._fast_encoding()
        if fast is not None:
            out = [fast.encode(text) for text in texts]
            slow = [text for text, ids in zip(texts, out) if ids is None]
            if not slow:
                return out
            again = iter(self._backend.encode_batch_fast(slow, add_special_tokens=False))
            return [ids if ids is not None else next(again).ids for ids in out]
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        bare = not add_special_tokens or self._bare_specials
        if self.chunk_cache is not None and bare:
            return self.chunk_cache.encode(text, self._encode_batch)
        if bare and (quick := self._fast_encoding()) is not None and (ids := quick.encode(text)) is not None:
            return ids
        if self._backend is not None:
            fast = getattr(self._backend, "encode_batch_fast", None)  # tokenizers >= 0.21: no offsets
            if fast is not None:
                return fast([text], add_special_tokens=add_special_tokens)[0].ids
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self._tok.eos_token_id is not None:
            ids.add(int(self._tok.eos_token_id))
        for file_name in ("config.json", "generation_config.json"):
            cfg_path = self.path / file_name
            if not cfg_path.is_file():
                continue
            value = json.loads(cfg_path.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of ``text`` with the tokenizer's usual special tokens (e.g. BOS)."""
        return self._encode(text, add_special_tokens=True)

    def encode_chat(self, messages: Sequence[ChatMessage | dict]) -> list[int]:
        """Ids of the chat rendered by the chat template, ready for the assistant's turn."""
        return self._encode(self._render_chat(messages), add_special_tokens=False)

    def encode_chat_parts(self, messages: Sequence[ChatMessage | dict], marker: str) -> list[list[int]]:
        """The chat rendered as :meth:`encode_chat` does, cut where ``marker``
        stands, each piece encoded on its own (``len(result)`` = occurrences + 1).

        Encoding the pieces apart keeps every token out of the marker's place,
        so a media item's placeholder run starts exactly at the cut.
        """
        return [self._encode(piece, add_special_tokens=False) for piece in self._render_chat(messages).split(marker)]

    def _render_chat(self, messages: Sequence[ChatMessage | dict]) -> str:
        turns = [dict(zip(("role", "content"), _role_and_content(m))) for m in messages]
        if self._tok.chat_template:
            return self._tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=True)
        return self._tok.decode(list(token_ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns token ids appended one step at a time into text deltas.

    Each :meth:`add` decodes a short window — the tokens since the previous
    emitted boundary plus those before it as context — and returns only the
    new text. A delta is held back while the window's text ends in U+FFFD,
    i.e. while the last tokens carry an incomplete UTF-8 sequence, so a
    multi-byte character split across tokens is sent whole. Concatenating all
    deltas plus :meth:`flush` equals ``tokenizer.decode(all_ids)`` for
    byte-level tokenizers. Cost per call is O(window), not O(sequence).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are already in self.text

    @property
    def has_pending(self) -> bool:
        """True when some added tokens' text is still held back."""
        return self._read_offset < len(self.token_ids)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append ``token_ids``; return the text they complete (may be ``""``)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        window_text = self._tokenizer.decode(self.token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text still held back (an incomplete character becomes U+FFFD)."""
        if not self.has_pending:
            return ""
        prefix_text = self._tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        window_text = self._tokenizer.decode(self.token_ids[self._prefix_offset :])
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


@functools.lru_cache(maxsize=8)
def _load_hf(path: str, name: str) -> Tokenizer:
    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return ByteTokenizer(name=name)  # a model directory without a tokenizer
    return HfTokenizer(Path(path), name)


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer for a model spec, cached per spec (and per resolved model).

    Args:
        spec: ``"bytes"`` for the :class:`ByteTokenizer`; otherwise a model
            spec as accepted by :func:`kvflow.models.resolve.resolve_model`.
            A model directory without tokenizer files gets a
            :class:`ByteTokenizer` named after the model.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: unknown model spec.
    """
    if spec == "bytes":
        return ByteTokenizer()
    resolved = resolve_model(spec)
    return _load_hf(str(resolved.path), resolved.name)
