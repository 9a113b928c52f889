"""Tokenizers for pre-tokenizing requests, loaded off the event loop and cached.

The bridge tokenizes every prompt with the tokenizer its model's workers
advertise, so each request carries ``token_ids`` (the router hashes them into
KV blocks) and its ISL is known before it is sent (HTTP 413 above the limit).
Loading a Hugging Face tokenizer takes 0.1–2 s and encoding a long prompt
milliseconds, so both run in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.schemas import ChatMessage

__all__ = ["TokenizerCache", "encode_chat", "encode_prompt"]


def _default_loader(spec: str) -> Any:
    from kvflow.workers.tokenizer import load_tokenizer

    return load_tokenizer(spec)


class TokenizerCache:
    """Loads each tokenizer spec once; concurrent first requests share one load.

    ``loader(spec) -> tokenizer`` runs in a worker thread (default:
    :func:`kvflow.workers.tokenizer.load_tokenizer`). A failed load is not
    cached, so the next request retries it.
    """

    def __init__(self, loader: Callable[[str], Any] | None = None) -> None:
        self._loader = loader or _default_loader
        self._loaded: dict[str, Any] = {}
        self._loading: dict[str, asyncio.Task] = {}

    async def get(self, spec: str) -> Any:
        """The tokenizer for ``spec``.

        Raises:
            Exception: whatever the loader raised (e.g. an unknown model path).
        """
        tok = self._loaded.get(spec)
        if tok is not None:
            return tok
        task = self._loading.get(spec)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self._loader, spec))
            self._loading[spec] = task
            task.add_done_callback(lambda _t, s=spec: self._loading.pop(s, None))
        tok = await asyncio.shield(task)
        self._loaded[spec] = tok
        return tok


async def encode_chat(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """``tokenizer.encode_chat(messages)`` in a thread; returns ids, shape [ISL]."""
    return await asyncio.to_thread(tokenizer.encode_chat, list(messages))


async def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode_prompt(text)`` in a thread; returns ids, shape [ISL]."""
    return await asyncio.to_thread(tokenizer.encode_prompt, text)
