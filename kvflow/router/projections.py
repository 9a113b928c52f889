"""Whole-topic projections: every router replica reads ALL of a topic.

The routing table and the KV index must be identical on every router
replica, so they cannot be fed by a consumer group (which would give each
replica a share of the partitions). :func:`follow_topics` assigns every
partition of some topics to one plain consumer, starts at the beginning, and
feeds each record to its topic's handler, forever. A restarted router thus rebuilds the same
state from the topic as a replica that never stopped: the state is a pure
fold of the log (event sourcing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiokafka import ConsumerRecord, TopicPartition

from kvflow.settings import Settings
from kvflow.streams.catalog import TopicSpec
from kvflow.streams.kafka import FOLLOW_POLL_MS, NOT_HOT, adapt_fetch_wait, make_consumer, start_consumer

__all__ = ["Follow", "follow_topics"]

log = logging.getLogger(__name__)

Handler = Callable[[ConsumerRecord], Awaitable[None]]


@dataclass(frozen=True)
class Follow:
    """One topic of a :func:`follow_topics` consumer.

    ``caught_up`` is set once the history present at start has been folded
    in; ``hot``: its new records put the consumer in its fast-polling mode on
    the embedded broker (False for background topics such as heartbeats).
    """

    spec: TopicSpec
    handler: Handler
    caught_up: asyncio.Event | None = None
    hot: bool = True


async def follow_topics(settings: Settings, follows: list[Follow], *, policies: list | None = None,
                        idle_cap: Callable[[], int] | None = None) -> None:
    """Feed every record of each followed topic (all partitions, from offset 0)
    to its handler, through one consumer, forever.

    One consumer for all the router's projections: on the embedded broker
    each consumer costs a fetch per poll, so three topics in one fetch cost a
    third of three consumers, idle and under load. Within a fetched batch the
    topics are handled in the order of ``follows`` (the router lists
    ``kv-events`` before ``inflight``, so a finish record usually finds its
    KV events already folded). Every ``caught_up`` is set after the first
    fetch that returns nothing. Handler errors are logged and skipped (the
    handler is expected to dead-letter bad records itself). The consumer's
    :class:`~kvflow.streams.fetch_wait.FetchWaitPolicy` (if any) is appended
    to ``policies``, so the caller can wake it; ``idle_cap`` bounds its quiet
    wait (:func:`kvflow.streams.workers.liveness_wait` for a reader that
    judges liveness from heartbeats). Runs until cancelled.
    """
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await start_consumer(consumer)
    hot_topics = {f.spec.name for f in follows if f.hot}
    policy = adapt_fetch_wait(consumer, settings, hot_topics.__contains__ if hot_topics else NOT_HOT,
                              idle_cap=idle_cap)
    if policy is not None and policies is not None:
        policies.append(policy)
    order = {f.spec.name: i for i, f in enumerate(follows)}
    handlers = {f.spec.name: f.handler for f in follows}
    pending = [f.caught_up for f in follows if f.caught_up is not None and not f.caught_up.is_set()]
    try:
        tps = [TopicPartition(f.spec.name, p) for f in follows for p in range(f.spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while True:
            # Each getmany costs ~0.1 ms of CPU even when empty: poll slowly once caught up.
            batches = await consumer.getmany(timeout_ms=200 if pending else FOLLOW_POLL_MS, max_records=5000)
            if not batches and pending:
                for event in pending:
                    event.set()
                pending = []
            for tp in sorted(batches, key=lambda t: (order[t.topic], t.partition)):
                handler = handlers[tp.topic]
                for msg in batches[tp]:
                    try:
                        await handler(msg)
                    except Exception:  # noqa: BLE001 - a projection must outlive any one record
                        log.exception("projection failed on %s[%d]@%d", msg.topic, msg.partition, msg.offset)
    finally:
        await consumer.stop()

