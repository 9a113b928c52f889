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
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from aiokafka import ConsumerRecord, TopicPartition

from kvflow.schemas import Record, WorkerHeartbeat, WorkerRole, WorkerStatus, encode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import DeadLetterWriter, adapt_fetch_wait, make_consumer, make_producer

__all__ = ["QueueSlot", "SlotConfig"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)

POLL_TIMEOUT_MS = 1000
"""Longest wait of one poll of the queue, ms (how soon a stop is noticed while idle)."""


class SlotConfig(Protocol):
    """What a :class:`QueueSlot` reads of its worker's config: its id, its
    queue partition, the model it serves and the most records taken per poll."""

    worker_id: str
    slot: int
    model: str
    max_records: int


@dataclass(kw_only=True, eq=False)
class QueueSlot(Generic[R]):
    """Consume ``queue.<role>[config.slot]`` as worker ``config.worker_id``
    (serving ``config.model`` with ``engine``, both advertised in its
    heartbeats), up to ``config.max_records`` records a poll, on
    ``catalog``'s topics (default: ``settings.namespace``'s): decode each
    record as ``schema``, serve it with ``await handle(record, message)``
    (``message`` the raw Kafka record, e.g. for its headers), heartbeat.
    ``handle`` should answer failures rather than raise: an exception stops
    the worker with its batch uncommitted (it is served again on restart).

    ``on_start`` runs once the queue position is set, before the first
    heartbeat (e.g. to open a metrics endpoint); ``on_stop`` after the
    ``stopped`` heartbeat, before the consumer and producer close.

    ``busy`` counts the records of the current batch not yet served (the
    heartbeat's ``active_requests`` is 1 while any is, the rest are
    ``waiting_requests``); ``served`` counts those served since start.

    Raises:
        ValueError: ``slot`` is not a partition of the queue topic.
    """

    settings: Settings
    catalog: Catalog | None = None
    config: SlotConfig
    role: WorkerRole
    engine: str
    schema: type[R]
    handle: Callable[[R, ConsumerRecord], Awaitable[None]]
    heartbeat_fields: Callable[[], dict[str, Any]] = dict
    on_start: Callable[[], Awaitable[None]] | None = None
    on_stop: Callable[[], Awaitable[None]] | None = None
    status: WorkerStatus = field(default=WorkerStatus.serving, init=False)
    busy: int = field(default=0, init=False)
    served: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.catalog = self.catalog or Catalog(self.settings.namespace)
        self.worker_id, self.model, slot = self.config.worker_id, self.config.model, self.config.slot
        queue = self.catalog.queue(self.role)
        if slot >= queue.partitions:
            raise ValueError(f"slot {slot} >= {queue.partitions} queue partitions")
        self.queue_tp = TopicPartition(queue.name, slot)
        self.producer = make_producer(self.settings)
        self.consumer = make_consumer(self.settings, enable_auto_commit=False,
                                      group_id=f"{self.settings.namespace}.worker.{self.role.value}.{slot}")
        self.dlq = DeadLetterWriter(self.producer, self.catalog, consumer=self.worker_id)
        self.started_ms = now_ms()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Start, serve until :meth:`drain` or :meth:`stop`, then publish ``stopped``."""
        await self.producer.start()
        await self.consumer.start()
        beat: asyncio.Task | None = None
        try:
            self.consumer.assign([self.queue_tp])
            if await self.consumer.committed(self.queue_tp) is None:
                await self.consumer.seek_to_end(self.queue_tp)
            await self.consumer.position(self.queue_tp)
            adapt_fetch_wait(self.consumer, self.settings, self.queue_tp.topic.__eq__)
            if self.on_start is not None:
                await self.on_start()
            await self.announce()
            beat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            log.info("%s worker %s serving %s on %s[%d]", self.role.value, self.worker_id, self.model,
                     *self.queue_tp)
            await self._consume_loop()
        finally:
            if beat is not None:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
            self.status = WorkerStatus.stopped
            with contextlib.suppress(Exception):
                await self.announce()
            if self.on_stop is not None:
                await self.on_stop()
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

    async def _consume_loop(self) -> None:
        while not self._stop.is_set():
            batches = await self.consumer.getmany(self.queue_tp, timeout_ms=POLL_TIMEOUT_MS,
                                                  max_records=self.config.max_records)
            messages = batches.get(self.queue_tp, [])
            # Malformed records go to the dead-letter topic up front; only the rest count as work.
            decoded = [(r, m) for r, m in [(await self.dlq.decode(self.schema, m), m) for m in messages]
                       if r is not None]
            self.busy = len(decoded)
            for record, message in decoded:
                await self.handle(record, message)
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
