"""What the bridge's routes share: settings, the live-worker projection, the
response source, tokenizers and metrics.

The Kafka-facing parts are fields of :class:`BridgeState`, so the HTTP layer
can be mounted over any :class:`ResponseSource` (in production a started
:class:`~kvflow.streams.client.KvflowClient`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request

from kvflow.schemas import CancelReason, FinalResponse, InferenceRequest, ReplyTo, RequestMetrics, TokenDelta
from kvflow.settings import Settings
from kvflow.streams.bridge.api_keys import configured_api_keys
from kvflow.streams.bridge.attachments import Attachments
from kvflow.streams.bridge.metrics import BridgeMetrics
from kvflow.streams.bridge.responses_log import ResponsesLog
from kvflow.streams.bridge.tokenizers import TokenizerCache
from kvflow.streams.bridge.worker_registry import WorkerRegistry

__all__ = ["ResponseSource", "BridgeState", "get_state", "default_max_body_bytes", "admit", "release"]


class ResponseSource(Protocol):
    """Sends a request and yields its response records
    (:class:`~kvflow.streams.client.KvflowClient` is one).

    ``stream`` yields :class:`TokenDelta` records then one
    :class:`FinalResponse`, and raises
    :class:`~kvflow.streams.client.RequestTimeout` when nothing arrives in time.
    When the iterator it returns has a ``first_offset`` (the offset of the
    request's first record on its responses partition, set once it
    arrived), the bridge's SSE events carry ids a client can resume from,
    through the source's ``resume(request, cursor)``
    (:meth:`~kvflow.streams.client.KvflowClient.resume`) when it has one.
    """

    @property
    def reply_to(self) -> ReplyTo:
        """Where responses to this source's requests are written."""

    def stream(self, request: InferenceRequest) -> AsyncIterator[TokenDelta | FinalResponse]:
        """Submit ``request`` and iterate its response records."""


def default_max_body_bytes(max_prompt_tokens: int) -> int:
    """Body size limit: 64 bytes per allowed prompt token, at least 1 MiB.

    A token is ~4 characters of English text; JSON ``\\uXXXX`` escapes take
    6 bytes per character, so 64 bytes/token leaves room for escaped CJK
    text and chat framing while bounding what one request can make the
    bridge buffer (2 MiB at the default 32768 tokens).
    """
    return max(1 << 20, 64 * max_prompt_tokens)


@dataclass
class BridgeState:
    """Everything a bridge route needs (stored on ``app.state.bridge``).

    ``publish_metrics`` takes each finished request's
    :class:`RequestMetrics` (None: not published). ``cancel`` publishes a
    cancel record for a request whose client disconnected before its final
    response (None: the worker finishes such requests). ``max_body_bytes`` bounds
    the request body (HTTP 413 above; default ``Settings.max_request_bytes``,
    else :func:`default_max_body_bytes`); ``retry_after_s`` is the
    ``Retry-After`` of 503 answers, one worker TTL by default: by then a
    starting worker has registered or a dead one has been expired.
    ``api_keys`` are the bearer keys ``/v1`` routes accept (default: those
    the settings configure, :func:`configured_api_keys`; empty: open).
    ``attachments`` tracks the HTTP streams of each request and the cancels
    of disconnected streams waiting ``settings.stream_resume_grace_s`` for a resume.
    """

    settings: Settings
    source: ResponseSource
    registry: WorkerRegistry = field(default_factory=WorkerRegistry)
    tokenizers: TokenizerCache = field(default_factory=TokenizerCache)
    metrics: BridgeMetrics = field(default_factory=BridgeMetrics)
    publish_metrics: Callable[[RequestMetrics], None] | None = None
    cancel: Callable[[str, CancelReason], Awaitable[None]] | None = None
    max_body_bytes: int = 0
    retry_after_s: float = 0.0
    max_inflight: int = 0
    """Requests served at once before new ones get 503 (0: ``settings.bridge_max_inflight_requests``)."""
    inflight: int = 0
    api_keys: frozenset[str] | None = field(default=None, repr=False)
    refresh_workers: Callable[[str], Awaitable[None]] | None = None
    """Called with a model that is not being served before answering 404/503:
    brings the worker projection up to date (returns at most ~0.5 s later);
    None: answer from the projection as it is."""
    attachments: Attachments | None = None
    responses_log: ResponsesLog | None = None
    """Stored ``/v1/responses`` conversations (default: in memory only)."""
    embeddings_sent: dict[str, int] = field(default_factory=dict)
    """Embeddings requests this bridge sent to each embedding worker (by id)
    and has no answer to yet: the bridge's own load on it, between heartbeats."""
    stage_sent: dict[str, int] = field(default_factory=dict)
    """Image requests this bridge sent through each image-stage worker (by id)
    and has no answer to yet, likewise."""

    def __post_init__(self) -> None:
        if self.responses_log is None:
            self.responses_log = ResponsesLog()
        if self.attachments is None:
            self.attachments = Attachments(self.settings.stream_resume_grace_s)
        if self.api_keys is None:
            self.api_keys = configured_api_keys(self.settings)
        if self.max_body_bytes <= 0:
            self.max_body_bytes = (self.settings.max_request_bytes
                                   or default_max_body_bytes(self.settings.max_prompt_tokens))
        if self.max_inflight <= 0:
            self.max_inflight = self.settings.bridge_max_inflight_requests
        if self.retry_after_s <= 0:
            self.retry_after_s = math.ceil(self.settings.worker_ttl_ms / 1000)
        self.metrics.track_workers(self.registry)
        self.metrics.track_tokenizers(self.tokenizers.chunk_chars, self.tokenizers.pool_jobs)


def admit(state: BridgeState) -> bool:
    """Count one more request in flight; False (nothing counted) when
    ``state.max_inflight`` are already."""
    if state.inflight >= state.max_inflight:
        return False
    state.inflight += 1
    return True


def release(state: BridgeState) -> None:
    """One request of :func:`admit` finished."""
    state.inflight = max(0, state.inflight - 1)


def get_state(request: Request) -> BridgeState:
    """FastAPI dependency: the :class:`BridgeState` of the serving app.

    Raises:
        RuntimeError: the app was built without a state (its lifespan did not run).
    """
    state = getattr(request.app.state, "bridge", None)
    if state is None:
        raise RuntimeError("bridge state missing: was the app started through its lifespan?")
    return state
