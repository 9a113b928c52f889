"""Small asyncio helpers shared by kvflow's long-lived services."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["cancel_and_wait"]


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
