"""The LoRA adapter manager: URI sources, the cache keyed by URI, one load per adapter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvflow.workers import lora
from kvflow.workers.lora import AdapterError, AdapterManager, fetch_adapter, register_source


def make_adapter(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return d


class FakeEngine:
    """Records load/unload calls; ``gate`` holds loads until set."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, Path]] = []
        self.unloads: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def load(self, name: str, path: Path) -> None:
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("bad weights")
        self.loads.append((name, path))

    async def unload(self, name: str) -> None:
        self.unloads.append(name)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def manager(engine, tmp_path) -> AdapterManager:
    return AdapterManager(engine.load, engine.unload, tmp_path / "cache")


async def test_file_uri_and_bare_path(tmp_path):
    d = make_adapter(tmp_path, "a")
    assert await fetch_adapter(d.as_uri(), tmp_path / "cache") == d
    assert await fetch_adapter(str(d), tmp_path / "cache") == d
    with pytest.raises(AdapterError, match="adapter_config.json"):
        await fetch_adapter((tmp_path / "missing").as_uri(), tmp_path / "cache")


async def test_unknown_scheme_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="no adapter source for scheme 'nosuch'"):
        await fetch_adapter("nosuch://bucket/a", tmp_path)


async def test_concurrent_loads_of_one_adapter_load_once(manager, engine, tmp_path):
    d = make_adapter(tmp_path, "a")
    engine.gate.clear()
    calls = [asyncio.create_task(manager.load("sql", d.as_uri())) for _ in range(8)]
    await asyncio.sleep(0)
    engine.gate.set()
    got = await asyncio.gather(*calls)
    assert engine.loads == [("sql", d)]
    assert {a.name for a in got} == {"sql"} and "sql" in manager
    assert await manager.load("sql", d.as_uri()) is got[0]  # loaded: no second engine load
    assert len(engine.loads) == 1


async def test_name_bound_to_one_uri(manager, tmp_path):
    a, b = make_adapter(tmp_path, "a"), make_adapter(tmp_path, "b")
    await manager.load("x", a.as_uri())
    with pytest.raises(AdapterError, match="is loaded from"):
        await manager.load("x", b.as_uri())


async def test_failed_load_is_reported_and_retried(manager, engine, tmp_path):
    d = make_adapter(tmp_path, "a")
    engine.fail = True
    with pytest.raises(AdapterError, match="load failed: bad weights"):
        await manager.load("x", d.as_uri())
    assert manager.names() == []
    engine.fail = False
    await manager.load("x", d.as_uri())
    assert manager.names() == ["x"]


async def test_list_and_unload(manager, engine, tmp_path):
    a, b = make_adapter(tmp_path, "a"), make_adapter(tmp_path, "b")
    await manager.load("one", a.as_uri())
    await manager.load("two", b.as_uri())
    assert [(x.name, x.path) for x in manager.list()] == [("one", a), ("two", b)]
    assert await manager.unload("one") is True
    assert await manager.unload("one") is False
    assert engine.unloads == ["one"] and manager.names() == ["two"]


async def test_custom_scheme_is_fetched_once_into_the_cache(manager, engine, tmp_path, monkeypatch):
    """A registered source downloads into the slot the manager picks; the slot is keyed by URI."""
    monkeypatch.setattr(lora, "_SOURCES", dict(lora._SOURCES))
    fetched: list[str] = []

    async def memory_source(uri: str, dest: Path) -> Path:
        fetched.append(uri)
        await asyncio.sleep(0.01)
        dest.mkdir(parents=True)
        (dest / "adapter_config.json").write_text("{}")
        return dest

    register_source("mem", memory_source)
    uri = "mem://adapters/sql"
    # Two names of one URI at once: one download.
    first, second = await asyncio.gather(manager.load("sql", uri), manager.load("sql2", uri))
    assert fetched == [uri]
    assert first.path == second.path and first.path.parent == manager.cache_dir
    # A new manager on the same cache directory finds the download there.
    again = AdapterManager(engine.load, engine.unload, manager.cache_dir)
    assert (await again.load("sql", uri)).path == first.path
    assert fetched == [uri]
    other = await manager.load("other", "mem://adapters/other")
    assert other.path != first.path and fetched == [uri, "mem://adapters/other"]
