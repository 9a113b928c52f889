"""The bridge's uvicorn server: a one-second tick while connections are open,
none while there are none, a date header refreshed when a connection arrives,
and a stop at once when asked."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn
from fastapi import FastAPI

from kvflow.streams.bridge import server as server_mod
from kvflow.streams.bridge.server import TICKS_PER_HEADER, BridgeServer
from tests.deployment import serve_app


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    return app


async def test_serves_with_a_date_header_and_stops():
    async with serve_app(_app()) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            reply = await http.get("/ping")
    assert reply.status_code == 200 and reply.json() == {"ok": True}
    assert "date" in reply.headers  # uvicorn's default header, refreshed by the tick


async def test_every_tick_refreshes_the_headers(monkeypatch):
    monkeypatch.setattr(server_mod, "TICK_S", 0.001)
    server = BridgeServer(uvicorn.Config(_app()))
    server.server_state.connections.add(object())  # a connection is open: the loop ticks
    counters = []

    async def on_tick(counter: int) -> bool:
        counters.append(counter)
        return len(counters) == 5

    server.on_tick = on_tick
    await asyncio.wait_for(server.main_loop(), 60)
    assert len(counters) == 5 and all(c % TICKS_PER_HEADER == 0 for c in counters)


class _TickCounter:
    """A :class:`BridgeServer` (hour-long tick) whose ``on_tick`` only counts and
    says to exit once ``should_exit`` is set; ``loop`` is its running main loop."""

    def __init__(self) -> None:
        self.server = BridgeServer(uvicorn.Config(_app()))
        self.ticks = 0
        self.server.on_tick = self._on_tick
        self.loop: asyncio.Task | None = None

    async def _on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return self.server.should_exit

    async def start(self) -> None:
        self.loop = asyncio.create_task(self.server.main_loop())
        await asyncio.wait_for(_until(lambda: self.ticks == 1), 60)


async def test_a_shutdown_request_wakes_the_tick_at_once(monkeypatch):
    # With an hour-long tick, main_loop returns only if setting should_exit wakes it.
    monkeypatch.setattr(server_mod, "TICK_S", 3600.0)
    counted = _TickCounter()
    await counted.start()
    counted.server.should_exit = True
    await asyncio.wait_for(counted.loop, 60)
    assert counted.ticks == 2 and counted.server.should_exit


async def test_an_idle_loop_waits_for_a_connection_and_ticks_when_one_arrives(monkeypatch):
    # No connection and an hour-long tick: only the new connection can bring the second tick.
    monkeypatch.setattr(server_mod, "TICK_S", 3600.0)
    counted = _TickCounter()
    await counted.start()
    counted.server.server_state.connections.add(object())
    await asyncio.wait_for(_until(lambda: counted.ticks == 2), 60)
    counted.server.should_exit = True
    await asyncio.wait_for(counted.loop, 60)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0)


async def test_a_request_after_an_idle_spell_carries_a_date_refreshed_for_its_connection(monkeypatch):
    import uvicorn.server as uvicorn_server

    async with serve_app(_app()) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/ping")).status_code == 200
        # The connection is closed: the loop sleeps. The next connection must refresh the header.
        marker = "Mon, 01 Jan 2046 00:00:00 GMT"
        monkeypatch.setattr(uvicorn_server, "formatdate", lambda *a, **k: marker)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            reply = await http.get("/ping")
    assert reply.status_code == 200 and reply.headers["date"] == marker
