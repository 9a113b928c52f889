"""Noticing that an HTTP client went away, and telling the workers.

While the bridge waits for a request's records it also waits for the ASGI
``http.disconnect`` message (:func:`unless_disconnected`). Once the client is
gone before the final record, :func:`cancel_upstream` publishes one
:class:`~kvflow.schemas.CancelRequest` so the worker stops generating and
frees the request's KV blocks instead of finishing an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from kvflow.schemas import CancelReason
from kvflow.streams.bridge.metrics import BridgeMetrics

__all__ = ["ClientDisconnected", "unless_disconnected", "cancel_upstream", "CANCEL_SEND_TIMEOUT_S", "CancelFn"]

log = logging.getLogger(__name__)
T = TypeVar("T")

CancelFn = Callable[[str, CancelReason], Awaitable[None]]
"""Publishes a cancel for a request id (``KvflowClient.cancel`` in production)."""

CANCEL_SEND_TIMEOUT_S = 5.0
"""How long the bridge waits for the broker to take a cancel record before
giving up (logged and counted as failed); bounds the clean-up of one
disconnected request when the broker is unreachable."""


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the answer was ready."""


async def _disconnect(http_request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect
    # (servers send it when the peer closes, or once the response is done).
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(http_request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it.

    Call only after the request body has been read.

    Raises:
        ClientDisconnected: the client went away before ``work`` finished
            (``work`` has been cancelled and awaited).
        Exception: whatever ``work`` raises.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(http_request))
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        gone = not task.done()  # the result wins a tie with the disconnect
    finally:
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
    if gone:
        # A receive that failed also ends here: that connection is unusable too.
        if not watcher.cancelled() and watcher.exception() is not None:
            log.debug("disconnect watcher failed: %r", watcher.exception())
        raise ClientDisconnected
    return task.result()


async def cancel_upstream(cancel: CancelFn | None, metrics: BridgeMetrics, endpoint: str, request_id: str,
                          reason: CancelReason = CancelReason.client_disconnected) -> None:
    """Publish one cancel of ``request_id`` and count it in
    ``kvflow_bridge_cancels_total{endpoint, result}`` (``sent`` or
    ``failed``). Never raises: a failed cancel is logged, and the worker then
    finishes the request as it would have without one. A ``cancel`` of None
    (a bridge without Kafka) does nothing.
    """
    if cancel is None:
        return
    try:
        await asyncio.wait_for(cancel(request_id, reason), CANCEL_SEND_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - clean-up of a gone client must not raise
        metrics.cancels.labels(endpoint, "failed").inc()
        log.warning("could not publish the cancel of %s: %r", request_id, exc)
        return
    metrics.cancels.labels(endpoint, "sent").inc()
    log.info("cancelled %s: %s", request_id, reason.value)
