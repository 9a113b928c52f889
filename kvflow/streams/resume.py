"""Reading one request's response records back from the responses topic.

A stream is resumed by replaying its request's records from the first one
(:class:`~kvflow.streams.follow.StreamCursor`): a consumer of its own is
assigned the request's responses partition at ``first_offset`` and passes
on the records keyed with the request id, then keeps reading live records.
It works on any client or bridge replica, whichever slot it owns, because
the partition and offset travel in the cursor; no index or consumer group
is needed, and the embedded broker's unusable time lookup is not used.

Cost: the replay reads every record of the partition from the request's
first one on (the traffic of the reader that owned it since the request
started), filtering by key before decoding.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiokafka import TopicPartition

from kvflow.schemas import FinalResponse, RecordError, ResponseEvent, TokenDelta, decode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.follow import StreamCursor
from kvflow.streams.kafka import adapt_fetch_wait, make_consumer

__all__ = ["StreamNotFound", "Tick", "read_request_records"]

log = logging.getLogger(__name__)


class StreamNotFound(LookupError):
    """The responses partition holds no record of the request at the cursor's
    ``first_offset`` (a wrong cursor, or records the broker no longer has)."""


@dataclass(frozen=True)
class Tick:
    """Yielded after each fetch that passed on no record of the request.

    ``caught_up`` is True once the reader reached the partition's end as of
    its first fetch: every record written before the replay started has
    been passed on.
    """

    caught_up: bool


async def read_request_records(settings: Settings, catalog: Catalog, cursor: StreamCursor, *,
                               poll_ms: int = 500) -> AsyncIterator[tuple[int, TokenDelta | FinalResponse] | Tick]:
    """``(offset, record)`` for each response record of ``cursor.request_id`` in
    its partition from ``cursor.first_offset`` on, in order, forever (close
    the iterator to stop); a :class:`Tick` after each fetch of ``poll_ms`` at
    most that brought none. Malformed records are skipped (the partition's
    own reader dead-letters them).

    Raises:
        StreamNotFound: the record at ``first_offset`` is not the request's,
            or the partition ends before it.
        aiokafka.errors.KafkaError: the broker cannot be reached.
    """
    rid = cursor.request_id
    key = rid.encode()
    tp = TopicPartition(catalog.responses.name, cursor.partition)
    if not 0 <= cursor.partition < catalog.responses.partitions:
        raise StreamNotFound(f"{catalog.responses.name} has no partition {cursor.partition}")
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, cursor.first_offset)
        adapt_fetch_wait(consumer, settings)
        live_from: int | None = None  # the partition's end at the first fetch that knew it
        checked = caught_up = False
        while True:
            batch = (await consumer.getmany(tp, timeout_ms=poll_ms)).get(tp, [])
            if live_from is None:
                live_from = consumer.highwater(tp)
                if live_from is not None and live_from <= cursor.first_offset:
                    raise StreamNotFound(f"{tp.topic}[{tp.partition}] ends at {live_from}, before the first "
                                         f"record of {rid} at {cursor.first_offset}")
            passed = False
            for msg in batch:
                if not checked:
                    if msg.offset != cursor.first_offset or msg.key != key:
                        raise StreamNotFound(f"{tp.topic}[{tp.partition}]@{cursor.first_offset} is not a "
                                             f"response record of {rid}")
                    checked = True
                if msg.key != key:
                    continue
                try:
                    event = decode(ResponseEvent, msg.value)
                except RecordError:
                    continue
                if event.request_id == rid:
                    passed = True
                    yield msg.offset, event
            if not caught_up and live_from is not None and await consumer.position(tp) >= live_from:
                caught_up = True
                yield Tick(caught_up=True)
            elif not passed:
                yield Tick(caught_up=caught_up)
    finally:
        await consumer.stop()
