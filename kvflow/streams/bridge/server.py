"""The bridge's uvicorn server, ticking once a second instead of ten times.

uvicorn's ``Server.main_loop`` wakes every 100 ms to refresh the ``date``
header (every tenth tick) and to notice a shutdown request. On an idle
deployment those ten wake-ups a second were a visible share of the bridge
process's CPU (counted on ``kvflow up`` at idle: about a quarter of the
timers its main event loop fired). Here the loop ticks once a second, which
keeps the header exact to the second, and a shutdown request wakes it at
once instead of waiting for the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

__all__ = ["BridgeServer", "TICK_S", "TICKS_PER_HEADER"]

TICK_S = 1.0
"""Seconds between the server's housekeeping ticks."""

TICKS_PER_HEADER = 10
"""uvicorn refreshes its default headers on ticks whose counter is a multiple
of this (``uvicorn/server.py``, ``on_tick``); every tick here passes such a
counter, so the date header is refreshed at every tick."""


class BridgeServer(uvicorn.Server):
    """A :class:`uvicorn.Server` whose housekeeping tick is :data:`TICK_S`.

    Same constructor, ``serve()`` and ``run()`` as :class:`uvicorn.Server`;
    setting ``should_exit`` (what uvicorn's signal handlers and callers do)
    wakes the tick loop at once when done on the server's event loop thread.
    """

    _exit_event: asyncio.Event | None = None

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
        """Tick every :data:`TICK_S` until ``on_tick`` says to exit."""
        self._exit_event = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + TICKS_PER_HEADER) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_event.wait(), TICK_S)
