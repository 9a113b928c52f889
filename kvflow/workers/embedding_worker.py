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
import contextlib
import logging
import os
import socket
from dataclasses import dataclass

from aiokafka import TopicPartition

from kvflow.schemas import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorInfo,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
    deadline_exceeded,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer
from kvflow.workers.encoder import Encoder, EncoderError

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


class EmbeddingWorker:
    """Adapts an :class:`Encoder` to Kafka. ``await run()`` until drained or stopped."""

    def __init__(self, settings: Settings, config: EmbeddingWorkerConfig, encoder: Encoder,
                 catalog: Catalog | None = None) -> None:
        self.settings = settings
        self.config = config
        self.encoder = encoder
        self.catalog = catalog or Catalog(settings.namespace)
        queue = self.catalog.queue(WorkerRole.embedding)
        if config.slot >= queue.partitions:
            raise ValueError(f"slot {config.slot} >= {queue.partitions} queue partitions")
        self.queue_tp = TopicPartition(queue.name, config.slot)
        self.producer = make_producer(settings)
        self.consumer = make_consumer(settings, group_id=f"{settings.namespace}.worker.embedding.{config.slot}",
                                      enable_auto_commit=False)
        self.dlq = DeadLetterWriter(self.producer, self.catalog, consumer=config.worker_id)
        self.status = WorkerStatus.serving
        self.started_ms = now_ms()
        self.busy = 0  # requests taken from the queue and not answered
        self.served = 0
        self._stop = asyncio.Event()
        self._beat: asyncio.Task | None = None

    async def run(self) -> None:
        """Start, serve until :meth:`drain` or :meth:`stop`, then publish ``stopped``."""
        await self.producer.start()
        await self.consumer.start()
        try:
            self.consumer.assign([self.queue_tp])
            if await self.consumer.committed(self.queue_tp) is None:
                await self.consumer.seek_to_end(self.queue_tp)
            await self.consumer.position(self.queue_tp)
            adapt_fetch_wait(self.consumer, self.settings, self.queue_tp.topic.__eq__)
            await self._announce()
            self._beat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            log.info("embedding worker %s serving %s on %s[%d]", self.config.worker_id, self.config.model,
                     *self.queue_tp)
            await self._consume_loop()
        finally:
            if self._beat is not None:
                self._beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._beat
            self.status = WorkerStatus.stopped
            with contextlib.suppress(Exception):
                await self._announce()
            await self.consumer.stop()
            await self.producer.stop()
            log.info("embedding worker %s stopped after %d requests", self.config.worker_id, self.served)

    async def drain(self) -> None:
        """Stop taking work without losing any: heartbeat ``draining`` (the
        bridges stop sending here), keep serving for two heartbeat periods
        (requests sent before they saw it), then stop."""
        if self.status is not WorkerStatus.serving:
            return
        self.status = WorkerStatus.draining
        await self._announce()
        await asyncio.sleep(2 * self.settings.heartbeat_interval_ms / 1000)
        self._stop.set()

    def stop(self) -> None:
        """Stop after the request being encoded."""
        self._stop.set()

    async def _consume_loop(self) -> None:
        while not self._stop.is_set():
            batches = await self.consumer.getmany(self.queue_tp, timeout_ms=1000,
                                                  max_records=self.config.max_records)
            records = batches.get(self.queue_tp, [])
            requests = [r for r in [await self.dlq.decode(EmbeddingRequest, m) for m in records] if r is not None]
            self.busy = len(requests)
            for request in requests:
                await self._answer(request, await self._serve(request))
                self.busy -= 1
                self.served += 1
            if records:
                await self.consumer.commit({self.queue_tp: records[-1].offset + 1})

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

    async def _answer(self, request: EmbeddingRequest, result: EmbeddingResult) -> None:
        await self.producer.send(request.reply_to.topic, encode(result), key=request.request_id.encode(),
                                 partition=request.reply_to.partition)

    def _heartbeat_record(self) -> WorkerHeartbeat:
        # An encoder holds no KV: one-token "blocks", none of them.
        return WorkerHeartbeat(
            worker_id=self.config.worker_id, role=WorkerRole.embedding, status=self.status, model=self.config.model,
            engine=ENGINE_NAME, tokenizer=self.config.tokenizer, block_size=1,
            context_length=self.encoder.max_tokens, kv_total_blocks=0,
            queue_topic=self.queue_tp.topic, queue_partition=self.queue_tp.partition,
            active_requests=min(self.busy, 1), waiting_requests=max(0, self.busy - 1), ts_ms=now_ms(),
            ttl_ms=self.settings.worker_ttl_ms, started_ms=self.started_ms,
            host=f"{socket.gethostname()}:{os.getpid()}")

    async def _heartbeat(self) -> None:
        await self.producer.send_and_wait(self.catalog.workers.name, encode(self._heartbeat_record()),
                                          key=self.config.worker_id.encode())

    async def _announce(self) -> None:
        """A heartbeat for a start or status change: ring the readers parked in long polls."""
        await self._heartbeat()
        produced(self.catalog.workers.name)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_ms / 1000)
            try:
                await self._heartbeat()
            except Exception:  # noqa: BLE001 - keep beating through transient broker errors
                log.exception("heartbeat failed")
