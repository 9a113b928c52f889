"""The responses reader of ``KvflowClient`` on the real embedded broker: with no
stream in flight it parks in long waits and reports itself healthy while it
waits; a reader stuck behind unread records is still replaced, and the stream
it held goes on."""

from __future__ import annotations

import asyncio

from kvflow.schemas import FinalResponse, FinishReason, encode
from kvflow.streams import client as client_module
from kvflow.streams.client import KvflowClient
from kvflow.streams.kafka import FOLLOW_POLL_MS, make_producer

MODEL = "mock-reader"


async def answer(settings, catalog, request, text: str) -> None:
    """Write ``request``'s final record to its reply slot, as a worker would."""
    producer = make_producer(settings)
    await producer.start()
    try:
        final = FinalResponse(request_id=request.request_id, text=text, finish_reason=FinishReason.stop)
        await producer.send_and_wait(catalog.responses.name, encode(final), key=request.request_id.encode(),
                                     partition=request.reply_to.partition)
    finally:
        await producer.stop()


async def final_of(stream) -> FinalResponse:
    return [event async for event in stream][-1]


async def test_an_idle_reader_parks_in_long_waits_and_is_healthy_while_it_waits(kafka, waiter):
    settings, catalog = kafka
    client = KvflowClient(settings, catalog, timeout_s=120)
    timeouts: list[int] = []
    real = client._consumer.getmany

    async def recording(*partitions, **kwargs):
        timeouts.append(kwargs.get("timeout_ms"))
        return await real(*partitions, **kwargs)

    client._consumer.getmany = recording
    await client.start()
    try:
        await waiter(lambda: timeouts and client._waiting, timeout_s=60)
        assert timeouts[0] == FOLLOW_POLL_MS  # no stream in flight: one long wait, not one a second
        health = client.health()
        assert health.ok and health.lag == 0 and health.since_progress_s == 0.0
        # A record ends the long wait: a stream opened while the reader is parked is answered.
        request = client.new_request(MODEL, prompt="parked")
        result = asyncio.create_task(final_of(client.stream(request)))
        await waiter(lambda: request.request_id in client._pending or result.done(), timeout_s=60)
        await answer(settings, catalog, request, "answered")
        final = await asyncio.wait_for(result, 120)
        assert final.text == "answered" and client.reader_restarts == 0
    finally:
        await client.stop()


async def test_a_reader_stuck_behind_unread_records_is_replaced(kafka, waiter, monkeypatch):
    settings, catalog = kafka
    monkeypatch.setattr(client_module, "STALL_S", 1.0)
    client = KvflowClient(settings, catalog, timeout_s=120)

    async def stuck(*partitions, **kwargs):  # the first reader's fetches never return a record
        await asyncio.Event().wait()

    client._consumer.getmany = stuck
    await client.start()
    try:
        request = client.new_request(MODEL, prompt="stuck")
        result = asyncio.create_task(final_of(client.stream(request)))
        await waiter(lambda: request.request_id in client._pending or result.done(), timeout_s=60)
        await answer(settings, catalog, request, "after the restart")
        final = await asyncio.wait_for(result, 120)
        assert final.text == "after the restart"
        assert client.reader_restarts >= 1
    finally:
        await client.stop()


async def test_an_idle_reader_waits_no_longer_than_an_earlier_slot_is_kept(kafka):
    settings, catalog = kafka
    client = KvflowClient(settings, catalog)
    now = 1000.0
    assert client._poll_ms(now) == FOLLOW_POLL_MS  # nothing in flight, no earlier slot
    client._left_at[3] = now - client_module.SLOT_GRACE_S + 5.0  # its grace ends in 5 s
    assert 4990 <= client._poll_ms(now) <= 5000
    client._left_at[3] = now - client_module.SLOT_GRACE_S - 60.0  # past its grace (its streams ran long)
    assert client._poll_ms(now) == client_module.BUSY_POLL_MS
    client._left_at[3] = now  # just left: the grace outlasts the longest wait
    assert client._poll_ms(now) == min(FOLLOW_POLL_MS, int(client_module.SLOT_GRACE_S * 1000))
    client._pending["r"] = (asyncio.Queue(), 0)
    assert client._poll_ms(now) == client_module.BUSY_POLL_MS
