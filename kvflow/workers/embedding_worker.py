"""The embedding worker process: consume one slot of ``queue.embedding``,
encode, answer on each request's ``reply_to``.

Data flow: ``queue.embedding[slot]`` → :class:`~kvflow.workers.encoder.Encoder`
→ one :class:`~kvflow.schemas.EmbeddingResult` per request. The worker
heartbeats on the workers topic with role ``embedding`` (the bridge picks a
worker among these; routers never route generation requests to them).

Requests are encoded one at a time, in queue order, each in one or more
batched forward passes over its inputs (an encoder keeps no state between
requests, so there is nothing to interleave). The forward pass runs in a
thread so heartbeats keep flowing. Delivery matches the generation worker:
the queue position is committed under ``<namespace>.worker.embedding.<slot>``
after each batch of records is answered, and a drain (SIGTERM) answers what
was routed before it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiokafka import ConsumerRecord

from kvflow.schemas import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorInfo,
    WorkerRole,
    deadline_exceeded,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.workers.encoder import Encoder, EncoderError
from kvflow.workers.queue_slot import QueueSlot

__all__ = ["EmbeddingWorkerConfig", "EmbeddingWorker", "ENGINE_NAME"]

log = logging.getLogger(__name__)

ENGINE_NAME = "hf-encoder"
"""``engine`` of an embedding worker's heartbeats."""


@dataclass
class EmbeddingWorkerConfig:
    """Identity of one embedding worker: ``slot`` is its queue partition,
    ``model`` the served model name, ``tokenizer`` the encoder's directory
    (advertised so producers could count tokens); ``max_records`` caps the
    records taken per poll."""

    worker_id: str
    slot: int
    model: str
    tokenizer: str = ""
    max_records: int = 16


@dataclass(eq=False)
class EmbeddingWorker:
    """Adapts an :class:`Encoder` to Kafka: ``slot`` (a
    :class:`~kvflow.workers.queue_slot.QueueSlot`) feeds it requests and
    heartbeats for it; ``await worker.slot.run()`` until drained or stopped.
    """

    settings: Settings
    config: EmbeddingWorkerConfig
    encoder: Encoder
    catalog: Catalog | None = None

    def __post_init__(self) -> None:
        # An encoder advertises its tokenizer (producers could count tokens) and longest input.
        self.slot = QueueSlot(settings=self.settings, catalog=self.catalog, config=self.config,
                              role=WorkerRole.embedding, engine=ENGINE_NAME, schema=EmbeddingRequest,
                              handle=self._handle, heartbeat_fields=lambda: {
                                  "tokenizer": self.config.tokenizer, "context_length": self.encoder.max_tokens})

    async def _handle(self, request: EmbeddingRequest, _message: ConsumerRecord) -> None:
        result = await self._serve(request)
        await self.slot.producer.send(request.reply_to.topic, encode(result), key=request.request_id.encode(),
                                      partition=request.reply_to.partition)

    async def _serve(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Encode one request; failures become an error result, never an exception."""
        base = {"request_id": request.request_id, "model": self.config.model, "worker_id": self.config.worker_id}
        if request.model != self.config.model:
            return EmbeddingResult(**base, error=ErrorInfo(
                message=f"this worker serves {self.config.model}, not {request.model}", type="invalid_request_error",
                code="model_not_found", status=404))
        if request.deadline_ms is not None and now_ms() >= request.deadline_ms:
            return EmbeddingResult(**base, error=deadline_exceeded(
                f"Request {request.request_id} reached its worker after its deadline."))
        try:
            vectors, tokens = await asyncio.to_thread(self.encoder.embed, request.texts, request.token_ids,
                                                      request.dimensions)
        except EncoderError as exc:
            return EmbeddingResult(**base, error=ErrorInfo(message=str(exc), type="invalid_request_error",
                                                           code="invalid_value", status=400, param=exc.param))
        except Exception as exc:  # noqa: BLE001 - report, never let one request kill the worker
            log.exception("embeddings request %s failed", request.request_id)
            return EmbeddingResult(**base, error=ErrorInfo(message=f"internal error: {exc!r}", code="worker_error"))
        return EmbeddingResult(**base, embeddings=vectors, prompt_tokens=tokens)
