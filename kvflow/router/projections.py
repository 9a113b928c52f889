"""Whole-topic projections: every router replica reads ALL of a topic.

The routing table and the KV index must be identical on every router
replica, so they cannot be fed by a consumer group (which would give each
replica a share of the partitions). :func:`follow_topic` assigns every
partition of a topic to a plain consumer, starts at the beginning, and feeds
each record to a handler, forever. A restarted router thus rebuilds the same
state from the topic as a replica that never stopped: the state is a pure
fold of the log (event sourcing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRecord, TopicPartition

from kvflow.settings import Settings
from kvflow.streams.catalog import TopicSpec
from kvflow.streams.kafka import NOT_HOT, adapt_fetch_wait, make_consumer

__all__ = ["follow_topic"]

log = logging.getLogger(__name__)

Handler = Callable[[ConsumerRecord], Awaitable[None]]


async def follow_topic(settings: Settings, spec: TopicSpec, handler: Handler,
                       caught_up: asyncio.Event | None = None, *, hot: bool = True,
                       idle_wait_ms: int | None = None, policies: list | None = None) -> None:
    """Feed every record of ``spec`` (all partitions, from offset 0) to ``handler``.

    ``caught_up`` is set after the first fetch that returns nothing, i.e.
    once the history present at start has been folded in. Handler errors are
    logged and skipped (the handler is expected to dead-letter bad records
    itself). ``hot``: new records put the consumer in its fast-polling mode
    on the embedded broker (False for background topics such as heartbeats);
    ``idle_wait_ms`` caps its fetch wait when quiet; its
    :class:`~kvflow.streams.fetch_wait.FetchWaitPolicy` (if any) is appended
    to ``policies``, so the caller can wake it. Runs until cancelled.
    """
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    policy = adapt_fetch_wait(consumer, settings, None if hot else NOT_HOT, idle_ms=idle_wait_ms)
    if policy is not None and policies is not None:
        policies.append(policy)
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            if not batches and caught_up is not None and not caught_up.is_set():
                caught_up.set()
            for tp in sorted(batches, key=lambda t: t.partition):
                for msg in batches[tp]:
                    try:
                        await handler(msg)
                    except Exception:  # noqa: BLE001 - a projection must outlive any one record
                        log.exception("projection of %s failed on %s[%d]@%d", spec.name, msg.topic,
                                      msg.partition, msg.offset)
    finally:
        await consumer.stop()
