"""A worker of one image stage: consume its slot of ``queue.<role>``, run
the stage on each record, send the stage's output record.

Data flow: ``queue.conditioning[slot]`` → :class:`~kvflow.workers.images.stages.ConditioningStage`
→ ``queue.diffusion[request.diffusion_partition]``, and
``queue.diffusion[slot]`` → :class:`~kvflow.workers.images.stages.DiffusionStage`
→ the request's ``reply_to`` on the responses topic. The worker heartbeats
on the workers topic with its stage's role (the bridge picks workers among
these; routers never route generation requests to them).

Records are served one at a time, in queue order, the model's work in a
thread so heartbeats keep flowing. Delivery is at least once, as for the
other workers: the queue position is committed under
``<namespace>.worker.<role>.<slot>`` after each batch's outputs are sent,
and a drain (SIGTERM) serves what was queued before it. A record that does
not decode goes to the dead-letter topic and the worker goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Protocol

from aiokafka import TopicPartition

from kvflow.schemas import Record, WorkerHeartbeat, WorkerRole, WorkerStatus, encode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer
from kvflow.workers.images.stages import Output

__all__ = ["Stage", "StageWorkerConfig", "StageWorker", "ENGINE_NAME"]

log = logging.getLogger(__name__)

ENGINE_NAME = "diffusers"
"""``engine`` of an image stage worker's heartbeats."""


class Stage(Protocol):
    """One stage: the schema of its input records and the (blocking) step from one to its output."""

    input_schema: type[Record]

    def run(self, record: Record) -> Output:
        """The output of one input record (errors become error records, never exceptions)."""


@dataclass
class StageWorkerConfig:
    """Identity of one stage worker: its ``role`` (stage) and ``slot`` (queue
    partition), the served ``model``, the ``tokenizer`` it advertises (the
    text stage's; ``""`` for the image stage) and ``context_length`` (the
    text stage's longest encoded prompt, tokens; None for the image stage);
    ``max_records`` caps the records taken per poll."""

    worker_id: str
    role: WorkerRole
    slot: int
    model: str
    tokenizer: str = ""
    context_length: int | None = None
    max_records: int = 4


class StageWorker:
    """Adapts a :class:`Stage` to Kafka. ``await run()`` until drained or stopped."""

    def __init__(self, settings: Settings, config: StageWorkerConfig, stage: Stage,
                 catalog: Catalog | None = None) -> None:
        self.settings = settings
        self.config = config
        self.stage = stage
        self.catalog = catalog or Catalog(settings.namespace)
        queue = self.catalog.queue(config.role)
        if config.slot >= queue.partitions:
            raise ValueError(f"slot {config.slot} >= {queue.partitions} queue partitions")
        self.queue_tp = TopicPartition(queue.name, config.slot)
        self.producer = make_producer(settings)
        self.consumer = make_consumer(
            settings, group_id=f"{settings.namespace}.worker.{config.role.value}.{config.slot}",
            enable_auto_commit=False)
        self.dlq = DeadLetterWriter(self.producer, self.catalog, consumer=config.worker_id)
        self.status = WorkerStatus.serving
        self.started_ms = now_ms()
        self.busy = 0  # records taken from the queue and not yet answered
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
            log.info("%s worker %s serving %s on %s[%d]", self.config.role.value, self.config.worker_id,
                     self.config.model, *self.queue_tp)
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
            log.info("%s worker %s stopped after %d records", self.config.role.value, self.config.worker_id,
                     self.served)

    async def drain(self) -> None:
        """Stop taking work without losing any: heartbeat ``draining`` (the
        bridges stop sending here), keep serving for two heartbeat periods
        (records sent before they saw it), then stop."""
        if self.status is not WorkerStatus.serving:
            return
        self.status = WorkerStatus.draining
        await self._announce()
        await asyncio.sleep(2 * self.settings.heartbeat_interval_ms / 1000)
        self._stop.set()

    def stop(self) -> None:
        """Stop after the record being served."""
        self._stop.set()

    async def _consume_loop(self) -> None:
        while not self._stop.is_set():
            batches = await self.consumer.getmany(self.queue_tp, timeout_ms=1000,
                                                  max_records=self.config.max_records)
            records = batches.get(self.queue_tp, [])
            inputs = [r for r in [await self.dlq.decode(self.stage.input_schema, m) for m in records]
                      if r is not None]
            self.busy = len(inputs)
            for record in inputs:
                await self._send(await asyncio.to_thread(self.stage.run, record))
                self.busy -= 1
                self.served += 1
            if records:
                await self.consumer.commit({self.queue_tp: records[-1].offset + 1})

    async def _send(self, output: Output) -> None:
        await self.producer.send_and_wait(output.topic, encode(output.record), key=output.key.encode(),
                                          partition=output.partition)
        produced(output.topic)

    def _heartbeat_record(self) -> WorkerHeartbeat:
        # A stage holds no KV: one-token "blocks", none of them.
        return WorkerHeartbeat(
            worker_id=self.config.worker_id, role=self.config.role, status=self.status, model=self.config.model,
            engine=ENGINE_NAME, tokenizer=self.config.tokenizer, block_size=1,
            context_length=self.config.context_length, kv_total_blocks=0,
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
