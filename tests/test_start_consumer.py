"""A consumer whose start is interrupted is stopped, not left reconnecting
(kvflow.streams.kafka.start_consumer), on the real embedded broker."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.streams.kafka import make_consumer, start_consumer


def interrupted_start(consumer, started: asyncio.Event) -> None:
    """Make ``consumer.start()`` do its real work (client bootstrapped, group joined), then hang:
    a cancellation then lands while the caller still awaits the start."""
    real_start = consumer.start

    async def start_then_hang() -> None:
        await real_start()
        started.set()
        await asyncio.Event().wait()

    consumer.start = start_then_hang


async def test_a_group_member_cancelled_while_starting_is_stopped(kafka):
    settings, catalog = kafka
    consumer = make_consumer(settings, catalog.inflight.name, group_id=f"{catalog.namespace}-joining")
    started = asyncio.Event()
    interrupted_start(consumer, started)
    task = asyncio.create_task(start_consumer(consumer))
    await asyncio.wait_for(started.wait(), 60)
    assert consumer._client._sync_task is not None  # the client's metadata task runs
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert consumer._closed and consumer._client._sync_task is None  # stopped: nothing left to reconnect


async def test_a_failed_start_raises_its_own_error_and_stops_the_consumer(kafka):
    settings, catalog = kafka
    consumer = make_consumer(settings, catalog.inflight.name)
    real_start = consumer.start

    async def start_then_fail() -> None:
        await real_start()
        raise RuntimeError("boom")

    consumer.start = start_then_fail
    with pytest.raises(RuntimeError, match="boom"):
        await start_consumer(consumer)
    assert consumer._closed and consumer._client._sync_task is None
