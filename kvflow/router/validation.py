"""Once-only dead-lettering of the topics every router replica folds whole.

Each router replica reads all of the workers, kv-events and inflight topics
itself (:mod:`kvflow.router.projections`), so a malformed record there is
seen by every replica, and each projection skips it. Which replica writes
it to the dead-letter topic is decided by a consumer group shared by all the
replicas of one router app: :func:`validate_paced` reads those topics in that
group and dead-letters what fails to decode, once per deployment.

Why not a Faust agent: the router's Faust consumer also reads the requests
topic, and on the embedded broker a fetch returns at once whenever any of its
partitions has a record. KV events, finish records and heartbeats arrive
many times a second under load, so agents on those topics kept the Faust
consumer fetching (and decoding every record a second time) about as often
as the projections did. This reader instead takes what arrived, then waits
:data:`VALIDATE_PACE_S`, its partitions paused, before the next batch: about
one fetch a second under load, and a long parked poll when idle
(docs/benchmarks.md, "Fewer produce requests and fetches").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRecord

from kvflow.schemas import RecordError
from kvflow.settings import Settings
from kvflow.streams.kafka import FOLLOW_POLL_MS, NOT_HOT, adapt_fetch_wait, make_consumer, start_consumer

__all__ = ["VALIDATE_PACE_S", "VALIDATE_SESSION_FACTOR", "validate_paced"]

log = logging.getLogger(__name__)

VALIDATE_PACE_S = 1.0
"""Seconds between two batches of :func:`validate_paced` (kvflow's choice): a
malformed record reaches the dead-letter topic at most about this late, and
the reader costs the broker about one fetch per this many seconds under load
instead of one per record arrival."""

VALIDATE_SESSION_FACTOR = 5
"""The validators' consumer group runs with a session timeout this many times
``session_timeout_ms`` (30 s at the defaults), heartbeating every third of it,
and commits its offsets as seldom (kvflow's choice). Nothing waits on this
reader, so a replica that dies may leave its partitions unchecked that much
longer; in exchange an idle router sends the broker one group heartbeat
every 10 s instead of every 2 s (docs/benchmarks.md, "Idle broker requests")."""

Check = Callable[[bytes], object]
WriteLetter = Callable[[ConsumerRecord, str], Awaitable[None]]


async def validate_paced(settings: Settings, group_id: str, checks: dict[str, Check], dead_letter: WriteLetter, *,
                         consumers: list | None = None, pace_s: float = VALIDATE_PACE_S) -> None:
    """Decode every record of the topics in ``checks`` (topic name → decoder
    raising :class:`~kvflow.schemas.RecordError`) as a member of consumer
    group ``group_id``, and pass each one that fails to ``dead_letter(record,
    reason)``, forever.

    The group starts at the earliest offset when it has no committed one, so
    a record written before any replica joined is still checked; offsets are
    auto-committed (at least once: a replica that dies between a dead letter
    and the next commit may leave the record to be dead-lettered again).
    Consecutive batches are at least ``pace_s`` seconds apart (the
    partitions stay paused in between). The started consumer is
    appended to ``consumers`` (for its :meth:`assignment`). Errors of
    ``dead_letter`` are logged and skipped. Runs until cancelled.

    Raises:
        ValueError: ``checks`` is empty or ``pace_s`` is negative.
    """
    if not checks:
        raise ValueError("nothing to validate")
    if pace_s < 0:
        raise ValueError(f"pace_s must be >= 0, got {pace_s}")
    session_ms = VALIDATE_SESSION_FACTOR * settings.session_timeout_ms
    consumer = make_consumer(settings, *checks, group_id=group_id, auto_offset_reset="earliest",
                             session_timeout_ms=session_ms, heartbeat_interval_ms=max(100, session_ms // 3),
                             auto_commit_interval_ms=max(100, session_ms // 3))
    await start_consumer(consumer)  # a router stopped while this member joins must not leave it running
    if consumers is not None:
        consumers.append(consumer)
    try:
        adapt_fetch_wait(consumer, settings, NOT_HOT)  # nothing here is urgent: park between records
        while True:
            batches = await consumer.getmany(timeout_ms=FOLLOW_POLL_MS, max_records=10_000)
            for tp, msgs in batches.items():
                check = checks[tp.topic]
                for msg in msgs:
                    try:
                        check(msg.value)
                    except RecordError as exc:
                        try:
                            await dead_letter(msg, str(exc))
                        except Exception:  # noqa: BLE001 - the reader must outlive any one record
                            log.exception("could not dead-letter %s[%d]@%d", msg.topic, msg.partition, msg.offset)
            if batches:
                # Let the next records gather, unfetched: aiokafka's fetcher keeps fetching every partition
                # with nothing buffered, so only pausing them all makes it one fetch per pace.
                held = consumer.assignment()
                consumer.pause(*held)
                try:
                    await asyncio.sleep(pace_s)
                finally:
                    consumer.resume(*(held & consumer.assignment()))
    finally:
        if consumers is not None and consumer in consumers:
            consumers.remove(consumer)
        await consumer.stop()
