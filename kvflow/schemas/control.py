"""Records on the cancels topic: asking workers to stop a request.

A cancel is a command (imperative name, like :class:`KvDumpRequest`): the
producer does not know which worker holds the request, so every worker reads
every cancel and acts only on the request ids it holds.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from kvflow.schemas.base import Record

__all__ = ["CancelReason", "CancelRequest"]


class CancelReason(str, Enum):
    """Why a request is cancelled.

    ``client_disconnected``: the HTTP client closed its connection before the
    final response (sent by the bridge). ``client_cancelled``: a client asked
    explicitly (``KvflowClient.cancel``). ``deadline_exceeded``: the
    request's ``deadline_ms`` passed before its final response (sent by the
    client or bridge that gave up on it); the worker ends it with a
    ``deadline_exceeded`` error instead of ``abort``.
    """

    client_disconnected = "client_disconnected"
    client_cancelled = "client_cancelled"
    deadline_exceeded = "deadline_exceeded"


class CancelRequest(Record):
    """Stop generating ``request_id`` and free its KV blocks.

    The worker holding the request aborts it in its engine and publishes a
    :class:`~kvflow.schemas.responses.FinalResponse` with ``finish_reason``
    ``abort`` to the request's ``reply_to``; every other worker ignores it.
    A cancel of an unknown or finished request changes nothing.

    ``requested_by`` names the producer (``bridge:<slot>``,
    ``client:<slot>``); ``ts_ms`` is when it was produced (epoch ms).
    """

    request_id: str = Field(min_length=1, max_length=256)
    reason: CancelReason
    requested_by: str = Field(min_length=1, max_length=256)
    ts_ms: int = Field(ge=0)
