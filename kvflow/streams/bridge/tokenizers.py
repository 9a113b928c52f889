"""Tokenizers for pre-tokenizing requests, loaded off the event loop and cached.

The bridge tokenizes every prompt with the tokenizer its model's workers
advertise, so each request carries ``token_ids`` (the router hashes them into
KV blocks) and its ISL is known before it is sent (HTTP 413 above the limit).
Loading a Hugging Face tokenizer takes 0.1–2 s and encoding a long prompt
milliseconds, so both run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.models.tokenizer import load_tokenizer
from kvflow.schemas import ChatMessage

__all__ = ["TokenizerCache", "encode_chat", "encode_prompt", "prewarm"]

log = logging.getLogger(__name__)


class TokenizerCache:
    """Loads each tokenizer spec once; concurrent first requests share one load.

    ``loader(spec) -> tokenizer`` runs in a worker thread (default:
    :func:`kvflow.models.tokenizer.load_tokenizer`). A failed load is not
    cached, so the next request retries it.
    """

    def __init__(self, loader: Callable[[str], Any] | None = None) -> None:
        self._loader = loader or load_tokenizer
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

    def loaded(self) -> dict[str, Any]:
        """The tokenizers loaded so far, by spec (a copy)."""
        return dict(self._loaded)


async def encode_chat(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """``tokenizer.encode_chat(messages)`` in a thread; returns ids, shape [ISL]."""
    return await asyncio.to_thread(tokenizer.encode_chat, list(messages))


async def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode_prompt(text)`` in a thread; returns ids, shape [ISL]."""
    return await asyncio.to_thread(tokenizer.encode_prompt, text)


async def prewarm(cache: TokenizerCache, specs: Callable[[], Sequence[str]], interval_s: float = 1.0) -> None:
    """Load every tokenizer ``specs()`` names (the live workers' models) before
    a request needs it, checking every ``interval_s``; runs until cancelled.

    The first load of a Hugging Face tokenizer imports transformers, holding
    the interpreter lock for seconds: done on the first request, it stalled
    the bridge and the router in the same process (the first requests of a
    load test waited seconds for their first token). A failed load is logged
    and retried at the next check.
    """
    while True:
        for spec in list(specs()):
            try:  # a loaded spec returns at once; one being loaded is shared
                await cache.get(spec)
            except Exception as exc:  # noqa: BLE001 - the request path reports it if it persists
                log.warning("cannot pre-load tokenizer %r: %s", spec, exc)
        await asyncio.sleep(interval_s)
