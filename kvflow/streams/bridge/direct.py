"""Requests the bridge sends straight to a worker's queue slot, no router
between: ``/v1/embeddings`` (:mod:`.embeddings`) and
``/v1/images/generations`` (:mod:`.images`).

Neither kind keeps KV between requests, so there is no cache overlap to
route by: the bridge takes the least loaded worker itself, counting what it
sent there and has no answer to yet on top of the worker's last heartbeat
(heartbeats come every ``heartbeat_interval_ms``, requests faster). Each
request gets one answer record on this bridge's responses slot.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka.errors import KafkaError
from fastapi import Request, Response

from kvflow.streams.bridge.errors import BridgeError, broker_unavailable, error_response, overloaded, request_timeout
from kvflow.streams.bridge.metrics import RequestObserver
from kvflow.streams.bridge.state import BridgeState, admit, release
from kvflow.streams.client import RequestTimeout
from kvflow.streams.workers import WorkerView

__all__ = ["least_loaded", "send_direct", "serve_direct"]


def least_loaded(workers: Sequence[WorkerView], sent: dict[str, int]) -> WorkerView:
    """The worker with the fewest requests waiting (heartbeat's active plus
    waiting requests, plus ``sent[worker_id]``: this bridge's unanswered
    sends), lowest id on ties.

    Raises:
        ValueError: ``workers`` is empty.
    """
    return min(workers, key=lambda w: (w.active_requests + w.waiting_requests + sent.get(w.worker_id, 0),
                                       w.worker_id))


async def send_direct(state: BridgeState, method: str, request: Any, partition: int, *,
                      through: Sequence[WorkerView], sent: dict[str, int], timeout_s: float, what: str) -> Any:
    """Send ``request`` with ``state.source.<method>(request, partition)`` and
    return its answer record; each worker of ``through`` counts one more
    unanswered send in ``sent`` meanwhile.

    Raises:
        BridgeError: 501 the source cannot send ``what`` requests (no ``method``);
            504 no answer within ``timeout_s`` seconds; 503 the broker failed.
    """
    send: Callable[[Any, int], Awaitable[Any]] | None = getattr(state.source, method, None)
    if send is None:
        raise BridgeError(501, f"This bridge cannot send {what} requests.", "server_error", code="unsupported")
    for w in through:
        sent[w.worker_id] = sent.get(w.worker_id, 0) + 1
    try:
        return await send(request, partition)
    except RequestTimeout:
        raise request_timeout(request.request_id, timeout_s) from None
    except KafkaError as exc:
        raise broker_unavailable(exc, state.retry_after_s) from None
    finally:
        for w in through:
            sent[w.worker_id] -= 1
            if sent[w.worker_id] <= 0:
                del sent[w.worker_id]


async def serve_direct(state: BridgeState, http_request: Request, endpoint: str,
                       answer: Callable[[BridgeState, Request], Awaitable[Response]]) -> Response:
    """Answer one request of ``endpoint`` (its Prometheus label) with
    ``await answer(state, http_request)``, or the OpenAI error of the
    :class:`BridgeError` it raises; 503 ``overloaded`` when the bridge
    already serves its most requests at once.

    Never raises for client mistakes; unexpected exceptions propagate to the
    app's last-resort handler (500).
    """
    if not admit(state):
        RequestObserver(state.metrics, endpoint).finish(503, "overloaded")
        return error_response(overloaded(1.0))
    observer = RequestObserver(state.metrics, endpoint, on_finish=lambda: release(state))
    try:
        response = await answer(state, http_request)
    except BridgeError as err:
        observer.finish(err.status, err.code)
        return error_response(err)
    except BaseException:
        observer.finish(500)
        raise
    observer.finish(200)
    return response
