"""LoRA adapter manager: fetch adapters by URI into a local cache, load each once.

An adapter is named by the client (the OpenAI ``model`` field names it, as
vLLM serves adapters) and located by a URI. :class:`AdapterManager`:

- **fetches** the URI through the source registered for its scheme
  (:func:`register_source`); ``file://`` is built in and returns the
  directory itself. A remote source (an ``s3://`` one, say) is an async
  function ``(uri, dest) -> Path`` that downloads the adapter directory
  (``adapter_config.json`` + weights) into ``dest`` and returns it, e.g.
  with boto3 ``download_file`` per key under the prefix, run through
  ``asyncio.to_thread``; none ships here because no S3 client is a
  dependency.
- **caches** a fetched adapter under ``cache_dir/<sha256(uri)[:16]>``, so a
  URI is fetched once per cache directory, whatever name it is loaded as.
- **loads** it into the engine through the ``load`` callback, exactly once
  per name even when many tasks ask at the same time: the first caller
  starts the load, the others await the same task.
- **unloads** through the ``unload`` callback and lists what is loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["AdapterError", "AdapterManager", "LoadedAdapter", "Source", "register_source", "fetch_adapter"]

log = logging.getLogger(__name__)

Source = Callable[[str, Path], Awaitable[Path]]
"""Fetches the adapter at a URI into a directory; returns the adapter directory."""

_SOURCES: dict[str, Source] = {}


class AdapterError(Exception):
    """An adapter cannot be fetched, loaded or unloaded (unknown scheme, missing files, engine refusal)."""


def register_source(scheme: str, source: Source) -> None:
    """Route URIs of ``scheme`` (``"s3"``, ``"hf"``, ...) to ``source``; replaces an earlier one."""
    _SOURCES[scheme.lower()] = source


async def _file_source(uri: str, dest: Path) -> Path:
    """``file:///abs/dir``: the directory itself (nothing is copied)."""
    path = Path(unquote(urlparse(uri).path))
    if not (path / "adapter_config.json").is_file():
        raise AdapterError(f"{uri}: no adapter_config.json in {path}")
    return path


register_source("file", _file_source)


async def fetch_adapter(uri: str, cache_dir: Path) -> Path:
    """The local directory of the adapter at ``uri``, fetched into ``cache_dir`` if remote.

    A bare path counts as ``file://``. The cache slot is
    ``cache_dir/<first 16 hex digits of sha256(uri)>``.

    Raises:
        AdapterError: no source for the URI's scheme, or the source failed.
    """
    scheme = urlparse(uri).scheme.lower() or "file"
    if scheme == "file" and not uri.startswith("file:"):
        uri = Path(uri).resolve().as_uri()
    source = _SOURCES.get(scheme)
    if source is None:
        raise AdapterError(f"{uri}: no adapter source for scheme {scheme!r} (known: {sorted(_SOURCES)})")
    dest = cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if scheme != "file" and (dest / "adapter_config.json").is_file():
        return dest
    try:
        return await source(uri, dest)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(f"{uri}: fetch failed: {exc}") from exc


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter loaded in the engine: its name, URI and local directory."""

    name: str
    uri: str
    path: Path


class AdapterManager:
    """Loads LoRA adapters by name and URI into one engine, once each.

    Args:
        load: ``async (name, path)`` loading the adapter directory into the
            engine (e.g. :meth:`kvflow.workers.engines.hf.HfEngine.load_lora`).
        unload: ``async (name)`` dropping it from the engine.
        cache_dir: where remote adapters are fetched to.
    """

    def __init__(self, load: Callable[[str, Path], Awaitable[None]], unload: Callable[[str], Awaitable[None]],
                 cache_dir: Path) -> None:
        self._load, self._unload = load, unload
        self.cache_dir = Path(cache_dir)
        self._loaded: dict[str, LoadedAdapter] = {}
        self._pending: dict[str, tuple[str, asyncio.Task]] = {}
        self._fetches: dict[str, asyncio.Task] = {}  # by URI: one download per URI at a time
        self._lock = asyncio.Lock()  # one load/unload reaches the engine at a time

    def list(self) -> list[LoadedAdapter]:
        """Loaded adapters, in load order."""
        return list(self._loaded.values())

    def names(self) -> list[str]:
        """Names of the loaded adapters, in load order."""
        return list(self._loaded)

    def __contains__(self, name: str) -> bool:
        return name in self._loaded

    async def load(self, name: str, uri: str) -> LoadedAdapter:
        """Load ``uri`` as ``name``; concurrent calls for one name share one load.

        Loading a name again with the same URI returns the loaded adapter.

        Raises:
            AdapterError: ``name`` is loaded (or loading) from another URI,
                or the fetch or the engine's load failed (a later call retries).
        """
        have = self._loaded.get(name)
        if have is not None:
            if have.uri != uri:
                raise AdapterError(f"adapter {name!r} is loaded from {have.uri}, not {uri}")
            return have
        pending = self._pending.get(name)
        if pending is None:
            task = asyncio.create_task(self._do_load(name, uri), name=f"lora-load-{name}")
            pending = self._pending[name] = (uri, task)
        elif pending[0] != uri:
            raise AdapterError(f"adapter {name!r} is being loaded from {pending[0]}, not {uri}")
        return await asyncio.shield(pending[1])

    async def _do_load(self, name: str, uri: str) -> LoadedAdapter:
        try:
            path = await self._fetch(uri)
            async with self._lock:
                try:
                    await self._load(name, path)
                except AdapterError:
                    raise
                except Exception as exc:
                    raise AdapterError(f"adapter {name!r}: load failed: {exc}") from exc
                adapter = self._loaded[name] = LoadedAdapter(name, uri, path)
            log.info("loaded LoRA adapter %s from %s", name, uri)
            return adapter
        finally:
            self._pending.pop(name, None)

    async def _fetch(self, uri: str) -> Path:
        task = self._fetches.get(uri)
        if task is None:
            task = self._fetches[uri] = asyncio.create_task(fetch_adapter(uri, self.cache_dir))
            task.add_done_callback(lambda _: self._fetches.pop(uri, None))
        return await asyncio.shield(task)

    async def unload(self, name: str) -> bool:
        """Unload ``name``; False when it is not loaded.

        Raises:
            AdapterError: the engine refused (e.g. requests still use it).
        """
        async with self._lock:
            if name not in self._loaded:
                return False
            try:
                await self._unload(name)
            except AdapterError:
                raise
            except Exception as exc:
                raise AdapterError(f"adapter {name!r}: unload failed: {exc}") from exc
            del self._loaded[name]
        log.info("unloaded LoRA adapter %s", name)
        return True
