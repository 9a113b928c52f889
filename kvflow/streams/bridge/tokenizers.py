"""Tokenizers for pre-tokenizing requests, loaded off the event loop and cached.

The bridge tokenizes every prompt with the tokenizer its model's workers
advertise, so each request carries ``token_ids`` (the router hashes them into
KV blocks) and its ISL is known before it is sent (HTTP 413 above the limit).
Loading a Hugging Face tokenizer takes 0.1–2 s and encoding a long prompt
milliseconds, so both run off the event loop: loading in a thread, encoding
in the cache's :class:`~kvflow.streams.bridge.tokenize_pool.TokenizePool`
when it has one (``settings.bridge_tokenize_processes``), else in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.models.tokenizer import load_tokenizer
from kvflow.schemas import ChatMessage
from kvflow.streams.bridge.tokenize_pool import TokenizePool, pooled
from kvflow.streams.bridge.tokenize_worker import chunk_counts

__all__ = ["TokenizerCache", "encode_chat", "encode_prompt", "prewarm"]

log = logging.getLogger(__name__)


class TokenizerCache:
    """Loads each tokenizer spec once; concurrent first requests share one load.

    ``loader(spec) -> tokenizer`` runs in a worker thread (default:
    :func:`kvflow.models.tokenizer.load_tokenizer`). A failed load is not
    cached, so the next request retries it. ``pool`` (optional) encodes the
    prompts of every spec it serves (:func:`encode_chat`, :func:`encode_prompt`).
    """

    def __init__(self, loader: Callable[[str], Any] | None = None, *, pool: TokenizePool | None = None) -> None:
        self._loader = loader or load_tokenizer
        self.pool = pool
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
            task = asyncio.ensure_future(asyncio.to_thread(self._load, spec))
            self._loading[spec] = task
            task.add_done_callback(lambda _t, s=spec: self._loading.pop(s, None))
        tok = await asyncio.shield(task)
        self._loaded[spec] = tok
        return tok

    def _load(self, spec: str) -> Any:
        tok = self._loader(spec)
        warm = getattr(tok, "warm", None)  # loaders in tests may return bare tokenizers
        if warm is not None:
            warm()
        return tok

    def loaded(self) -> dict[str, Any]:
        """The tokenizers loaded so far, by spec (a copy)."""
        return dict(self._loaded)

    def chunk_chars(self) -> dict[str, tuple[int, int]]:
        """Per spec, (prompt characters taken from a chunk cache, characters
        encoded), in this process and in the pool's children together; specs
        whose tokenizer has no chunk cache are left out."""
        out: dict[str, tuple[int, int]] = {}
        for spec, tok in self._loaded.items():
            if (counts := chunk_counts(tok)) is not None:
                out[spec] = counts
        for spec, (hit, miss) in (self.pool.chunk_chars.items() if self.pool is not None else ()):
            own = out.get(spec, (0, 0))
            out[spec] = (own[0] + hit, own[1] + miss)
        return out

    def pool_jobs(self) -> dict[str, int]:
        """Prompts the pool took, by where they were encoded: ``child`` (a
        child answered), ``inline`` (a thread of this process, every child
        busy; :data:`~kvflow.streams.bridge.tokenize_pool.INLINE_CHARS`),
        ``fallback`` (a thread of this process, the pool failed); empty
        without a pool."""
        if self.pool is None:
            return {}
        return {"child": self.pool.answered, "inline": self.pool.inline, "fallback": self.pool.fallbacks}


async def encode_chat(tokenizer: Any, messages: Sequence[ChatMessage], *, pool: TokenizePool | None = None,
                      spec: str | None = None) -> list[int]:
    """``tokenizer.encode_chat(messages)`` in ``pool`` when it serves ``spec``,
    else in a thread; returns ids, shape [ISL].

    Raises:
        jinja2.TemplateError: the chat template rejects the conversation.
    """
    if pool is not None and spec is not None and pooled(spec):
        return await pool.encode_chat(spec, messages, tokenizer)
    return await asyncio.to_thread(tokenizer.encode_chat, list(messages))


async def encode_prompt(tokenizer: Any, text: str, *, pool: TokenizePool | None = None,
                        spec: str | None = None) -> list[int]:
    """``tokenizer.encode_prompt(text)`` in ``pool`` when it serves ``spec``,
    else in a thread; returns ids, shape [ISL]."""
    if pool is not None and spec is not None and pooled(spec):
        return await pool.encode_prompt(spec, text, tokenizer)
    return await asyncio.to_thread(tokenizer.encode_prompt, text)


async def prewarm(cache: TokenizerCache, specs: Callable[[], Sequence[str]], interval_s: float = 1.0,
                  changed: asyncio.Event | None = None) -> None:
    """Load every tokenizer ``specs()`` names (the live workers' models) before
    a request needs it, checking every ``interval_s``, and at once when
    ``changed`` is set (it is cleared here; e.g. set on every heartbeat folded
    in, so an idle bridge need not poll often); runs until cancelled.

    The first load of a Hugging Face tokenizer imports transformers, holding
    the interpreter lock for seconds: done on the first request, it stalled
    the bridge and the router in the same process (the first requests of a
    load test waited seconds for their first token). With a tokenize pool the
    spec is loaded in its children as well (once it has loaded there). A
    failed load is logged and retried at the next check.
    """
    warmed: set[str] = set()
    while True:
        for spec in list(specs()):
            try:  # a loaded spec returns at once; one being loaded is shared
                await cache.get(spec)
                if cache.pool is not None and pooled(spec) and spec not in warmed and await cache.pool.warm(spec):
                    warmed.add(spec)
            except Exception as exc:  # noqa: BLE001 - the request path reports it if it persists
                log.warning("cannot pre-load tokenizer %r: %s", spec, exc)
        if changed is None:
            await asyncio.sleep(interval_s)
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), interval_s)
        changed.clear()
