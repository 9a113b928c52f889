"""The bridge's side of the responses log: store conversations, find them by id.

``/v1/responses`` stores each answered conversation as one
:class:`~kvflow.schemas.StoredResponse` on the responses-log topic, on the
partition its id hashes to (xxh64 of the id, modulo the partition count),
and keeps it in a bounded in-memory LRU. A ``previous_response_id`` this
bridge holds is answered from memory; another (stored by another bridge
replica, or before a restart) is looked up by reading that one partition
from its beginning. The cost of that read grows with the partition (the
topic's retention bounds it); it is paid once per id and bridge.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import xxhash
from aiokafka import AIOKafkaProducer, TopicPartition

from kvflow.schemas import RecordError, StoredResponse, decode, encode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import make_consumer

__all__ = ["ResponsesLog", "LOOKUP_MAX_WAIT_S"]

LOOKUP_MAX_WAIT_S = 5.0
"""Longest a lookup reads its partition (seconds); a record not reached by
then counts as missing."""

_IDLE_MS = 200  # an empty fetch this long stands for "read to the end" (Tansu's end offsets are unreliable)


class ResponsesLog:
    """Stored conversations by response id.

    With ``settings``/``catalog``/``producer`` (a started producer) entries
    go to the responses-log topic and misses are looked up there; without
    them (a bridge with no Kafka) the log is the in-memory LRU only.
    ``capacity`` is the most entries held in memory.
    """

    def __init__(self, settings: Settings | None = None, catalog: Catalog | None = None,
                 producer: AIOKafkaProducer | None = None, capacity: int = 10_000) -> None:
        self.settings, self.catalog, self.producer = settings, catalog, producer
        self.capacity = capacity
        self._cache: OrderedDict[str, StoredResponse] = OrderedDict()

    def _remember(self, entry: StoredResponse) -> None:
        self._cache[entry.response_id] = entry
        self._cache.move_to_end(entry.response_id)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def _partition(self, response_id: str) -> TopicPartition:
        assert self.catalog is not None
        spec = self.catalog.responses_log
        return TopicPartition(spec.name, xxhash.xxh64_intdigest(response_id.encode()) % spec.partitions)

    async def store(self, entry: StoredResponse) -> None:
        """Keep ``entry`` (memory, and the topic when connected; waits for the broker's ack).

        Raises:
            aiokafka.errors.KafkaError: the broker did not take the record.
        """
        self._remember(entry)
        if self.producer is not None:
            tp = self._partition(entry.response_id)
            await self.producer.send_and_wait(tp.topic, encode(entry), key=entry.response_id.encode(),
                                              partition=tp.partition)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored conversation of ``response_id``, or None when it is not stored.

        Raises:
            aiokafka.errors.KafkaError: the broker cannot be read.
        """
        held = self._cache.get(response_id)
        if held is not None:
            self._cache.move_to_end(response_id)
            return held
        if self.settings is None or self.catalog is None:
            return None
        found = await self._read(response_id)
        if found is not None:
            self._remember(found)
        return found

    async def _read(self, response_id: str) -> StoredResponse | None:
        tp = self._partition(response_id)
        consumer = make_consumer(self.settings, auto_offset_reset="earliest")
        await consumer.start()
        found = None
        try:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LOOKUP_MAX_WAIT_S
            while loop.time() < deadline:
                records = (await consumer.getmany(tp, timeout_ms=_IDLE_MS)).get(tp, [])
                if not records:
                    break
                for msg in records:
                    if msg.key != response_id.encode():
                        continue
                    try:
                        found = decode(StoredResponse, msg.value)
                    except RecordError:
                        continue  # not ours to dead-letter twice: the writer validated it
        finally:
            await consumer.stop()
        return found
