"""One worker's slot of a queue topic: the Kafka side the embedding, encode
and image-stage workers share.

A :class:`QueueSlot` owns the partition ``queue.<role>[slot]`` a worker
consumes (committed under the group ``<namespace>.worker.<role>.<slot>``),
the producer its answers and heartbeats go out on, its dead-letter writer
and its status. :meth:`QueueSlot.run` starts the consumer where the group
left off (at the end for a new group), heartbeats on the workers topic,
hands each decoded record to the worker's handler in queue order, commits
the position after each batch (at-least-once delivery, as for the
generation worker) and announces ``stopped`` on the way out.

These workers keep no KV, so their heartbeats advertise one-token "blocks",
none of them; the worker adds what is its own (tokenizer, context length,
media rows) through ``heartbeat_fields``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from aiokafka import ConsumerRecord, TopicPartition

from kvflow.schemas import Record, WorkerHeartbeat, WorkerRole, WorkerStatus, encode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer

__all__ = ["QueueSlot"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)

POLL_TIMEOUT_MS = 1000
"""Longest wait of one poll of the queue, ms (how soon a stop is noticed while idle)."""


class QueueSlot(Generic[R]):
    """Consume ``queue.<role>[slot]`` as worker ``worker_id``: decode each
    record as ``schema``, serve it with the worker's handler, heartbeat.

    ``busy`` counts the records of the current batch not yet served (the
    heartbeat's ``active_requests`` is 1 while any is, the rest are
    ``waiting_requests``); ``served`` counts those served since start.

    Raises:
        ValueError: ``slot`` is not a partition of the queue topic.
    """

    def __init__(self, settings: Settings, catalog: Catalog, *, role: WorkerRole, slot: int, worker_id: str,
                 model: str, engine: str, schema: type[R], max_records: int,
                 heartbeat_fields: Callable[[], dict[str, Any]] = dict) -> None:
        queue = catalog.queue(role)
        if slot >= queue.partitions:
            raise ValueError(f"slot {slot} >= {queue.partitions} queue partitions")
        self.settings = settings
        self.catalog = catalog
        self.role = role
        self.worker_id = worker_id
        self.model = model
        self.engine = engine
        self.schema = schema
        self.max_records = max_records
        self.heartbeat_fields = heartbeat_fields
        self.queue_tp = TopicPartition(queue.name, slot)
        self.producer = make_producer(settings)
        self.consumer = make_consumer(settings, group_id=f"{settings.namespace}.worker.{role.value}.{slot}",
                                      enable_auto_commit=False)
        self.dlq = DeadLetterWriter(self.producer, catalog, consumer=worker_id)
        self.status = WorkerStatus.serving
        self.started_ms = now_ms()
        self.busy = 0
        self.served = 0
        self._stop = asyncio.Event()

    async def run(self, handle: Callable[[R, ConsumerRecord], Awaitable[None]], *,
                  ready: Callable[[], Awaitable[None]] | None = None) -> None:
        """Start, serve each record with ``await handle(record, message)`` until
        :meth:`drain` or :meth:`stop`, then publish ``stopped``.

        ``ready`` runs once the queue position is set, before the first
        heartbeat (e.g. to start a metrics endpoint). ``handle`` should answer
        failures rather than raise: an exception stops the worker with the
        batch uncommitted.
        """
        await self.producer.start()
        await self.consumer.start()
        beat: asyncio.Task | None = None
        try:
            self.consumer.assign([self.queue_tp])
            if await self.consumer.committed(self.queue_tp) is None:
                await self.consumer.seek_to_end(self.queue_tp)
            await self.consumer.position(self.queue_tp)
            adapt_fetch_wait(self.consumer, self.settings, self.queue_tp.topic.__eq__)
            if ready is not None:
                await ready()
            await self.announce()
            beat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            log.info("%s worker %s serving %s on %s[%d]", self.role.value, self.worker_id, self.model,
                     *self.queue_tp)
            await self._consume_loop(handle)
        finally:
            if beat is not None:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
            self.status = WorkerStatus.stopped
            with contextlib.suppress(Exception):
                await self.announce()
            await self.consumer.stop()
            await self.producer.stop()
            log.info("%s worker %s stopped after %d records", self.role.value, self.worker_id, self.served)

    async def drain(self) -> None:
        """Stop taking work without losing any: heartbeat ``draining`` (senders
        stop choosing this worker), keep serving for two heartbeat periods
        (records sent before they saw it), then stop. No-op unless serving."""
        if self.status is not WorkerStatus.serving:
            return
        self.status = WorkerStatus.draining
        await self.announce()
        await asyncio.sleep(2 * self.settings.heartbeat_interval_ms / 1000)
        self._stop.set()

    def stop(self) -> None:
        """Stop after the record being served."""
        self._stop.set()

    async def _consume_loop(self, handle: Callable[[R, ConsumerRecord], Awaitable[None]]) -> None:
        while not self._stop.is_set():
            batches = await self.consumer.getmany(self.queue_tp, timeout_ms=POLL_TIMEOUT_MS,
                                                  max_records=self.max_records)
            messages = batches.get(self.queue_tp, [])
            # Malformed records go to the dead-letter topic up front; only the rest count as work.
            decoded = [(r, m) for r, m in [(await self.dlq.decode(self.schema, m), m) for m in messages]
                       if r is not None]
            self.busy = len(decoded)
            for record, message in decoded:
                await handle(record, message)
                self.busy -= 1
                self.served += 1
            if messages:
                await self.consumer.commit({self.queue_tp: messages[-1].offset + 1})

    def heartbeat_record(self) -> WorkerHeartbeat:
        """This worker's heartbeat now: no KV (one-token blocks, none of them),
        plus the worker's own ``heartbeat_fields``."""
        return WorkerHeartbeat(
            worker_id=self.worker_id, role=self.role, status=self.status, model=self.model, engine=self.engine,
            block_size=1, kv_total_blocks=0, queue_topic=self.queue_tp.topic,
            queue_partition=self.queue_tp.partition, active_requests=min(self.busy, 1),
            waiting_requests=max(0, self.busy - 1), ts_ms=now_ms(), ttl_ms=self.settings.worker_ttl_ms,
            started_ms=self.started_ms, host=f"{socket.gethostname()}:{os.getpid()}", **self.heartbeat_fields())

    async def announce(self) -> None:
        """A heartbeat for a start or status change: ring the readers parked in long polls."""
        await self._heartbeat()
        produced(self.catalog.workers.name)

    async def _heartbeat(self) -> None:
        await self.producer.send_and_wait(self.catalog.workers.name, encode(self.heartbeat_record()),
                                          key=self.worker_id.encode())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_ms / 1000)
            try:
                await self._heartbeat()
            except Exception:  # noqa: BLE001 - keep beating through transient broker errors
                log.exception("heartbeat failed")
