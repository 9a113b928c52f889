"""The bridge's uvicorn server, ticking once a second instead of ten times.

uvicorn's ``Server.main_loop`` wakes every 100 ms to refresh the ``date``
header (every tenth tick) and to notice a shutdown request. On an idle
deployment those ten wake-ups a second were a visible share of the bridge
process's CPU (counted on ``kvflow up`` at idle: about a quarter of the
timers its main event loop fired). Here the loop ticks once a second while
any connection is open, which keeps the header exact to the second; with none
open it sleeps until a connection arrives (the tick then runs before that
connection's first request is read) or a shutdown is asked for, which wakes
it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import uvicorn

__all__ = ["BridgeServer", "TICK_S", "TICKS_PER_HEADER"]

TICK_S = 1.0
"""Seconds between the server's housekeeping ticks."""

TICKS_PER_HEADER = 10
"""uvicorn refreshes its default headers on ticks whose counter is a multiple
of this (``uvicorn/server.py``, ``on_tick``); every tick here passes such a
counter, so the date header is refreshed at every tick."""


class _AnnouncedConnections(set):
    """uvicorn's set of open connections (each protocol adds itself when its
    connection is made), calling ``on_add`` after every add."""

    def __init__(self, on_add: Callable[[], None]) -> None:
        super().__init__()
        self._on_add = on_add

    def add(self, item: Any) -> None:
        super().add(item)
        self._on_add()


class BridgeServer(uvicorn.Server):
    """A :class:`uvicorn.Server` whose housekeeping tick is :data:`TICK_S`
    while connections are open, and none while there are none.

    Same constructor, ``serve()`` and ``run()`` as :class:`uvicorn.Server`;
    setting ``should_exit`` (what uvicorn's signal handlers and callers do)
    wakes the tick loop at once when done on the server's event loop thread.
    """

    _exit_event: asyncio.Event | None = None

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.server_state.connections = _AnnouncedConnections(self._wake)

    def _wake(self) -> None:
        if self._exit_event is not None:
            self._exit_event.set()

    @property
    def should_exit(self) -> bool:  # type: ignore[override]
        """Whether the server was asked to shut down."""
        return self.__dict__.get("_should_exit", False)

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self.__dict__["_should_exit"] = value
        if value and self._exit_event is not None:
            self._exit_event.set()

    async def main_loop(self) -> None:
        """Tick every :data:`TICK_S` while connections are open (at once on a
        new one) until ``on_tick`` says to exit."""
        self._exit_event = asyncio.Event()  # set on a shutdown request or a new connection
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + TICKS_PER_HEADER) % 864_000
            self._exit_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_event.wait(), TICK_S if self.server_state.connections else None)
