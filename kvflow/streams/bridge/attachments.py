"""Which HTTP streams of each request this bridge serves, and cancels that wait for a resume.

A streaming client that disconnects may come back with ``Last-Event-ID``
(:mod:`kvflow.streams.bridge.event_ids`), so its request is not cancelled
at once: the cancel waits ``Settings.stream_resume_grace_s`` and is dropped
if a stream of the request is attached again by then. A resumed stream
closes the streams of the same request still attached here (a client that
reconnected before the bridge noticed it left), so one stream at a time
reads each request on this bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["Attachment", "Attachments"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Attachment:
    """One HTTP stream of ``request_id``; ``close`` ends it (set once its response exists)."""

    request_id: str
    close: Callable[[], None] | None = None


@dataclass
class Attachments:
    """The streams attached per request id, and the delayed cancels pending.

    ``grace_s`` is how long a cancel waits for a resume (0: cancel at once).
    """

    grace_s: float
    _streams: dict[str, list[Attachment]] = field(default_factory=dict)
    _cancels: dict[str, asyncio.Task] = field(default_factory=dict)

    def attach(self, request_id: str) -> Attachment:
        """Count a new stream of ``request_id``; a cancel waiting for it is dropped."""
        pending = self._cancels.pop(request_id, None)
        if pending is not None:
            pending.cancel()
        attachment = Attachment(request_id)
        self._streams.setdefault(request_id, []).append(attachment)
        return attachment

    def supersede(self, keep: Attachment) -> None:
        """Close every other stream of ``keep.request_id`` (they stop reading at once)."""
        for other in list(self._streams.get(keep.request_id, ())):
            if other is not keep and other.close is not None:
                other.close()

    def detach(self, attachment: Attachment) -> None:
        """The stream ended (completed, failed or closed)."""
        streams = self._streams.get(attachment.request_id)
        if streams is None:
            return
        with contextlib.suppress(ValueError):
            streams.remove(attachment)
        if not streams:
            del self._streams[attachment.request_id]

    def attached(self, request_id: str) -> bool:
        """Whether a stream of ``request_id`` is attached."""
        return bool(self._streams.get(request_id))

    async def cancel_later(self, request_id: str, cancel: Callable[[], Awaitable[None]]) -> None:
        """Run ``cancel`` after ``grace_s`` unless a stream of ``request_id`` is
        attached by then (at once, and unless attached, when ``grace_s`` is 0).
        Returns without waiting for the grace."""
        if self.attached(request_id):
            return
        if self.grace_s <= 0:
            await cancel()
            return

        async def later() -> None:
            await asyncio.sleep(self.grace_s)
            if self._cancels.get(request_id) is asyncio.current_task():
                del self._cancels[request_id]
            if not self.attached(request_id):
                await cancel()

        previous = self._cancels.pop(request_id, None)
        if previous is not None:
            previous.cancel()
        self._cancels[request_id] = asyncio.get_running_loop().create_task(later(), name=f"cancel-{request_id}")

    def pending_cancels(self) -> int:
        """Cancels waiting for their grace to pass."""
        return len(self._cancels)

    def drop_pending(self) -> None:
        """Forget the cancels waiting for their grace (a bridge shutting down):
        their requests run on and stay resumable on another bridge."""
        for task in self._cancels.values():
            task.cancel()
        self._cancels.clear()
