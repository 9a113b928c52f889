"""Small asyncio helpers shared by kvflow's long-lived services."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "wait_or_kill", "loop_factory", "run"]

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended (a no-op for None).

    Its ``CancelledError`` is swallowed; any other exception it ends with is
    raised here, so a background loop that crashed does not stop silently.
    """
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def wait_or_kill(proc: asyncio.subprocess.Process, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` seconds for ``proc`` to exit, then kill it; returns its exit code.

    A process that exits just as the wait runs out is already reaped when it
    is killed; that ``ProcessLookupError`` is not raised.
    """
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        return await proc.wait()


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """The event-loop constructor for ``kind``: ``uvloop`` (uvloop's loop),
    ``asyncio`` (Python's own) or ``auto`` (uvloop when it can be imported).

    Raises:
        ValueError: an unknown ``kind``.
        ImportError: ``kind`` is ``uvloop`` and uvloop is not installed.
    """
    if kind not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event loop must be auto, uvloop or asyncio, not {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """Run ``main`` to completion on a new loop from :func:`loop_factory`, as
    :func:`asyncio.run` does (the loop is closed after, and Ctrl-C cancels ``main``).

    Returns what ``main`` returns.

    Raises:
        ValueError, ImportError: see :func:`loop_factory` (``main`` is closed unrun).
        Exception: whatever ``main`` raises.
    """
    try:
        factory = loop_factory(kind)
    except (ValueError, ImportError):
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
