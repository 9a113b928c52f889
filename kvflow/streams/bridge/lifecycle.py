"""Starting and stopping the bridge's Kafka parts.

One :func:`kafka_bridge_state` context builds a :class:`BridgeState` whose
response source is a started :class:`KvflowClient` (it owns one responses
partition and dead-letters malformed records there as ``bridge:<slot>``), whose worker projection follows the workers topic from its
beginning, whose ``RequestMetrics`` go to the metrics topic, whose
cancels of disconnected requests go to the cancels topic, and whose
``/v1/responses`` conversations go to the responses-log topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from kvflow.settings import Settings
from kvflow.streams.bridge.metrics import MetricsPublisher
from kvflow.streams.bridge.responses_log import ResponsesLog
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.tokenize_pool import TokenizePool
from kvflow.streams.bridge.tokenizers import TokenizerCache, prewarm
from kvflow.streams.bridge.worker_registry import ModelState, WorkerRegistry
from kvflow.streams.catalog import Catalog
from kvflow.streams.client import KvflowClient
from kvflow.streams.fetch_wait import wake
from kvflow.streams.kafka import NOT_HOT, adapt_fetch_wait, create_topics, make_consumer, make_producer
from kvflow.streams.workers import assign_workers_topic, catch_up, follow_workers, liveness_wait

__all__ = ["kafka_bridge_state"]

log = logging.getLogger(__name__)

MODEL_WAIT_S = 0.5
"""Longest a request for a model not (yet) served waits for the worker
projection to catch up before its 404/503: the projection's fetch is cut
short (:func:`~kvflow.streams.fetch_wait.wake`), so a worker that has sent
one heartbeat is seen within a few short fetches."""


@contextlib.asynccontextmanager
async def kafka_bridge_state(settings: Settings, catalog: Catalog, *, slot: int | None = None,
                             ensure_topics: bool = True) -> AsyncIterator[BridgeState]:
    """Connect the bridge to Kafka; yields its state, tears everything down on exit.

    ``slot`` is the responses partition of this bridge (random if None; give
    each bridge replica its own). ``ensure_topics`` creates missing catalog
    topics first (idempotent). Before yielding, the worker projection reads
    the workers topic up to its current end (at most 3 s), so a bridge
    started after its workers answers requests at once.

    Raises:
        ValueError: ``settings.bootstrap_servers`` is not set.
        aiokafka.errors.KafkaError: the broker cannot be reached.
    """
    if ensure_topics:
        await create_topics(settings, catalog)
    registry = WorkerRegistry()
    async with contextlib.AsyncExitStack() as stack:
        client = KvflowClient(settings, catalog, slot=slot, name="bridge")  # dead-letters bad responses
        await client.start()
        stack.push_async_callback(client.stop)

        producer = make_producer(settings)
        await producer.start()
        stack.push_async_callback(producer.stop)
        publisher = MetricsPublisher(producer, catalog)
        stack.push_async_callback(publisher.drain)

        consumer = make_consumer(settings)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        # Heartbeats do not make it poll fast; its idle wait is bounded by what liveness tolerates.
        adapt_fetch_wait(consumer, settings, NOT_HOT, idle_cap=liveness_wait(settings, registry.workers))
        await assign_workers_topic(consumer, catalog)
        seen = await catch_up(consumer, registry.apply)
        applied = asyncio.Event()
        beat = asyncio.Event()  # wakes the tokenizer pre-loader, which need not poll

        def apply(hb) -> None:
            registry.apply(hb)
            applied.set()  # wakes a request waiting for its model's first worker
            beat.set()

        follower = asyncio.create_task(follow_workers(consumer, apply), name="kvflow-bridge-workers")
        stack.push_async_callback(_cancel, follower)
        pool = TokenizePool(settings.bridge_tokenize_processes) if settings.bridge_tokenize_processes else None
        if pool is not None:
            stack.push_async_callback(pool.close)
        tokenizers = TokenizerCache(pool=pool)
        warm = asyncio.create_task(prewarm(tokenizers, lambda: [s for m in registry.models()
                                                                 if (s := registry.tokenizer_spec(m))],
                                           interval_s=10.0, changed=beat),
                                   name="kvflow-bridge-tokenizers")
        stack.push_async_callback(_cancel, warm)

        log.info("bridge connected: responses slot %d, %d heartbeats replayed, models %s",
                 client.slot, seen, registry.models())
        cancel = functools.partial(client.cancel, requested_by=f"bridge:{client.slot}")

        async def refresh_workers(model: str) -> None:
            wake(consumer)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + MODEL_WAIT_S
            def served() -> bool:  # by a generation or an embedding worker, or both image stages
                return ModelState.serving in (registry.model_state(model),
                                              registry.model_state(model, embedding=True),
                                              registry.model_state(model, image=True))

            while not served() and loop.time() < deadline:
                applied.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(applied.wait(), deadline - loop.time())

        yield BridgeState(settings=settings, source=client, registry=registry, publish_metrics=publisher.publish,
                          cancel=cancel, tokenizers=tokenizers, refresh_workers=refresh_workers,
                          responses_log=ResponsesLog(settings, catalog, producer))


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
