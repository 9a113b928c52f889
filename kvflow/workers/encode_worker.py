"""The encode worker process: turn the media of routed requests into embeddings
and pass each request on to the worker the router chose.

Data flow: ``queue.encode[slot]`` → :class:`~kvflow.workers.media_encoder.MediaEncoder`
(behind an :class:`~kvflow.workers.media_cache.EmbeddingCache`) → the same
:class:`~kvflow.schemas.InferenceRequest`, each media item now carrying its
embeddings instead of its bytes, on the worker queue partition its
``forward_to`` names (the router's choice; :mod:`kvflow.router.encode` picks
this worker). The record keeps its routing decision and trace headers, so
the language-model worker serves it as if the router had sent it directly.

A request this worker cannot serve is answered on its ``reply_to`` with an
error :class:`~kvflow.schemas.FinalResponse`: media that do not decode
(400 ``invalid_media``), a record without ``forward_to`` (400), a deadline
already past (504 ``deadline_exceeded``). A malformed queue record is
dead-lettered.

The worker heartbeats on the workers topic with role ``encode``, its
``model`` (the language model whose requests it encodes for) and
``media_tokens`` (rows per encoded item, which producers write as
placeholders). Requests are served one at a time in queue order, each
decode and forward pass in a thread so heartbeats keep flowing; the queue
position is committed under ``<namespace>.worker.encode.<slot>`` after each
batch of records is passed on. Its Prometheus series (cache hits, misses,
evictions and size, requests by outcome; :func:`kvflow.workers.prometheus.encode_registry`)
are served on ``settings.metrics_port`` when it is set.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

from aiokafka import ConsumerRecord

from kvflow.schemas import (
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    MediaItem,
    WorkerRole,
    deadline_exceeded,
    encode,
    now_ms,
)
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.workers.media_cache import EmbeddingCache
from kvflow.workers.media_encoder import MediaDecodeError, MediaEncoder
from kvflow.workers.queue_slot import QueueSlot

__all__ = ["ENGINE_NAME", "EncodeWorkerConfig", "EncodeWorker"]

log = logging.getLogger(__name__)

ENGINE_NAME = "media-encoder"
"""``engine`` of an encode worker's heartbeats."""


class _Refused(Exception):
    """A request answered with ``error`` instead of being passed on."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class EncodeWorkerConfig:
    """Identity of one encode worker: ``slot`` is its queue partition, ``model``
    the language model it encodes for; ``max_records`` caps the records taken per poll."""

    worker_id: str
    slot: int
    model: str
    max_records: int = 16


@dataclass(eq=False)
class EncodeWorker:
    """Adapts a :class:`MediaEncoder` to Kafka: ``slot`` (a
    :class:`~kvflow.workers.queue_slot.QueueSlot`) feeds it requests and
    heartbeats for it; ``await worker.slot.run()`` until drained or stopped.
    Its Prometheus endpoint opens and closes with the slot.

    ``cache`` holds up to ``settings.encode_cache_mb`` MiB of embeddings;
    ``outcomes`` counts requests ``forwarded`` and ``refused``.
    """

    settings: Settings
    config: EncodeWorkerConfig
    encoder: MediaEncoder
    catalog: Catalog | None = None

    def __post_init__(self) -> None:
        self.cache = EmbeddingCache(int(self.settings.encode_cache_mb * 2**20))
        self.outcomes: Counter[str] = Counter()
        self.metrics_server = None
        # Producers write media_tokens placeholder rows per item; an encode worker has no tokenizer of its own.
        self.slot = QueueSlot(settings=self.settings, catalog=self.catalog, config=self.config,
                              role=WorkerRole.encode, engine=ENGINE_NAME, schema=InferenceRequest, handle=self._serve,
                              heartbeat_fields=lambda: {"tokenizer": "", "media_tokens": self.encoder.media_tokens},
                              on_start=self._open_metrics, on_stop=self._close_metrics)

    async def _open_metrics(self) -> None:
        if self.settings.metrics_port is not None:
            from kvflow.streams.metrics_server import serve_metrics
            from kvflow.workers.prometheus import encode_registry

            self.metrics_server = await serve_metrics([encode_registry(self)], self.settings.metrics_host,
                                                      self.settings.metrics_port)

    async def _close_metrics(self) -> None:
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        log.info("encode worker %s: %s", self.config.worker_id, dict(self.outcomes))

    async def _serve(self, request: InferenceRequest, message: ConsumerRecord) -> None:
        """Encode ``request``'s media and pass it on; refusals are answered, never raised."""
        try:
            target = request.forward_to
            if target is None:
                raise _Refused(ErrorInfo(message="the request names no worker to pass it on to (forward_to); "
                                         "only routers send here", type="invalid_request_error",
                                         code="invalid_value", status=400))
            if request.deadline_ms is not None and now_ms() >= request.deadline_ms:
                raise _Refused(deadline_exceeded(f"Request {request.request_id} reached its encode worker after "
                                                 "its deadline."))
            media = [await self._encoded(item) for item in request.media or ()]
        except _Refused as refused:
            self.outcomes["refused"] += 1
            await self._answer(request, refused.error)
            return
        except Exception as exc:  # noqa: BLE001 - report, never let one request kill the worker
            log.exception("encoding the media of %s failed", request.request_id)
            self.outcomes["refused"] += 1
            await self._answer(request, ErrorInfo(message=f"internal error: {exc!r}", code="worker_error"))
            return
        record = request.model_copy(update={"media": media, "forward_to": None})
        await self.slot.producer.send(target.topic, encode(record), key=request.request_id.encode(),
                                      partition=target.partition, headers=list(message.headers or ()))
        produced(target.topic, target.partition)  # its worker may be parked in a long poll
        self.outcomes["forwarded"] += 1

    async def _encoded(self, item: MediaItem) -> MediaItem:
        """``item`` with its embeddings (from the cache, or encoded and cached) instead of its bytes.

        Raises:
            _Refused: the bytes do not decode (400 ``invalid_media``).
        """
        if item.embeds is not None:
            return item.model_copy(update={"data": None})
        embeds = self.cache.get(item.kind, item.content_hash)
        hit = embeds is not None
        if embeds is None:
            try:
                rows = await asyncio.to_thread(self.encoder.encode, item.kind, item.raw())
            except MediaDecodeError as exc:
                raise _Refused(ErrorInfo(message=f"{item.kind.value} at token {item.offset}: {exc}",
                                         type="invalid_request_error", code="invalid_media", status=400,
                                         param="messages")) from None
            embeds = PromptEmbeds.of(rows.numpy().tobytes(), tuple(rows.shape), "float32")
            self.cache.put(item.kind, item.content_hash, embeds)
        return item.model_copy(update={"data": None, "embeds": embeds, "from_cache": hit})

    async def _answer(self, request: InferenceRequest, error: ErrorInfo) -> None:
        final = FinalResponse(request_id=request.request_id, finish_reason=FinishReason.error,
                              worker_id=self.config.worker_id, routing=request.routing, error=error,
                              attempt=request.attempt)
        await self.slot.producer.send(request.reply_to.topic, encode(final), key=request.request_id.encode(),
                                      partition=request.reply_to.partition)
