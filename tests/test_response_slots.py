"""Responses slot rotation on the real embedded broker.

A client whose slot fills up moves its new requests to the least-filled
other slot and keeps reading the old one until its streams end. These tests
run a round-robin router and two mocker workers in this process, with a
rotation threshold of a few dozen records, and check that no token of any
stream is lost or repeated across moves, that old slots are dropped once
drained, and that a request built for a dropped slot is answered on the
current one.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from deployment import in_process_cluster, read_final

from kvflow.schemas import FinalResponse, ReplyTo, SamplingParams, TokenDelta
from kvflow.streams import client as client_module
from kvflow.workers.engines.mocker_core import MockerConfig

MODEL = "mock-slots"
ROTATE = 30  # records per slot before the client moves


@pytest.fixture
async def cluster(kafka, waiter, monkeypatch):
    """``(settings, catalog, client)``: a client that moves every ~30 records and drops drained slots at once."""
    settings, catalog = kafka
    monkeypatch.setattr(client_module, "SLOT_GRACE_S", 0.0)
    settings = settings.model_copy(update={"response_slot_rotate_records": ROTATE, "stream_flush_tokens": 1,
                                           "stream_flush_ms": 0.0})
    mocker = MockerConfig(speedup_ratio=20.0, block_size=16, num_kv_blocks=4096)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker,
                                  client_timeout_s=60) as (_, _workers, client):
        yield settings, catalog, client


async def collect(client, max_tokens: int, content: str) -> tuple[list[TokenDelta], FinalResponse, int]:
    """Stream one request; ``(deltas, final, slot it was answered on)``."""
    request = client.new_request(MODEL, prompt=content, sampling=SamplingParams(max_tokens=max_tokens,
                                                                                 ignore_eos=True))
    stream = client.stream(request)
    deltas: list[TokenDelta] = []
    async with contextlib.aclosing(stream):  # as the bridge does: a stream is closed once read
        async for event in stream:
            if isinstance(event, TokenDelta):
                deltas.append(event)
            else:
                return deltas, event, stream.partition
    raise AssertionError("stream ended without a final response")


def check_whole(deltas: list[TokenDelta], final: FinalResponse, max_tokens: int) -> None:
    """Every token once, in order: delta indices are contiguous and their tokens are the final's."""
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert len(final.token_ids) == max_tokens and final.error is None


async def test_streams_in_flight_lose_nothing_while_the_slot_moves(cluster, waiter):
    settings, catalog, client = cluster
    first = client.slot
    # Four concurrent streams of 80 tokens each write ~320 records: the slot moves while they run.
    results = await asyncio.gather(*(collect(client, 80, f"story {i}") for i in range(4)))
    for deltas, final, slot in results:
        check_whole(deltas, final, 80)
        assert slot == first  # answered where the request said, though the client moved meanwhile
    # More requests, one after another, each on the slot current when it was sent.
    answered_on = set()
    for i in range(4):
        deltas, final, slot = await collect(client, 40, f"poem {i}")
        check_whole(deltas, final, 40)
        answered_on.add(slot)
        assert (await read_final(settings, catalog, slot, final.request_id)).token_ids == final.token_ids
    assert client.rotations >= 2 and len(answered_on) >= 2
    assert first not in answered_on
    # The drained earlier slots are dropped: only the current one is read.
    await waiter(lambda: client.slots == (client.slot,), timeout_s=30)
    assert client.health().ok


async def test_a_request_built_for_a_dropped_slot_is_answered_on_the_current_one(cluster, waiter):
    settings, catalog, client = cluster
    early = client.new_request(MODEL, prompt="built early", sampling=SamplingParams(max_tokens=10, ignore_eos=True))
    while client.rotations == 0:
        await collect(client, 40, "fill the slot")
    await waiter(lambda: early.reply_to.partition not in client.slots, timeout_s=30)
    stream = client.stream(early)
    events = [e async for e in stream]
    assert isinstance(events[-1], FinalResponse) and len(events[-1].token_ids) == 10
    assert stream.partition == client.slot != early.reply_to.partition
    assert (await read_final(settings, catalog, stream.partition, early.request_id)).token_ids == events[-1].token_ids
    # A slot this client never used is still refused.
    unused = next(s for s in range(catalog.responses.partitions) if s not in client._slots_used)
    foreign = early.model_copy(update={"request_id": "foreign-1",
                                       "reply_to": ReplyTo(topic=catalog.responses.name, partition=unused)})
    with pytest.raises(ValueError, match="reply_to"):
        async for _ in client.stream(foreign):
            pass


async def test_a_real_kafka_setting_never_moves_the_slot(kafka):
    settings, catalog = kafka
    real = settings.model_copy(update={"embedded_broker": False, "response_slot_rotate_records": ROTATE})
    assert client_module.KvflowClient(real, catalog).rotate_records == 0
    assert client_module.KvflowClient(settings.model_copy(update={"response_slot_rotate_records": ROTATE}),
                                      catalog).rotate_records == ROTATE


async def test_a_restarted_reader_goes_on_from_every_slot_it_reads(cluster, waiter):
    _, _, client = cluster
    streams = [asyncio.create_task(collect(client, 400, f"tale {i}")) for i in range(4)]
    await waiter(lambda: len(client.slots) >= 2 or all(s.done() for s in streams), timeout_s=60)
    assert len(client.slots) >= 2, "the streams ended before the client moved"
    # The reader's consumer fails under it: the supervisor starts a new one at the first
    # record not yet delivered on each slot it reads.
    await client._consumer.stop()
    for deltas, final, _ in await asyncio.gather(*streams):
        check_whole(deltas, final, 400)
    assert client.reader_restarts >= 1
