"""The long-lived commands' event loop: uvloop's when installed, Python's on request."""

from __future__ import annotations

import asyncio

import pytest

from kvflow import aio
from kvflow.settings import Settings

uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed on this platform (kvflow requires it elsewhere)")


async def loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_python_s_loop():
    assert issubclass(aio.run(loop_type()), uvloop.Loop)
    assert issubclass(aio.run(loop_type(), "uvloop"), uvloop.Loop)
    plain = aio.run(loop_type(), "asyncio")
    assert not issubclass(plain, uvloop.Loop) and issubclass(plain, asyncio.BaseEventLoop)


def test_an_unknown_loop_is_refused_and_the_coroutine_closed():
    coro = loop_type()
    with pytest.raises(ValueError, match="uvloop or asyncio"):
        aio.run(coro, "trio")
    assert coro.cr_frame is None  # closed, so no "never awaited" warning


def test_the_setting_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVFLOW_EVENT_LOOP", raising=False)
    assert Settings().event_loop == "auto"
    monkeypatch.setenv("KVFLOW_EVENT_LOOP", "asyncio")
    assert Settings().event_loop == "asyncio"
    monkeypatch.setenv("KVFLOW_EVENT_LOOP", "gevent")
    with pytest.raises(ValueError):
        Settings()

