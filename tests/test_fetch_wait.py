"""The adaptive fetch-wait policy (pure) and its hook into aiokafka's fetcher."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from kvflow.settings import Settings
from kvflow.streams.fetch_wait import FetchWaitPolicy, install, wake
from kvflow.streams.kafka import NOT_HOT, adapt_fetch_wait, fetch_wait_policy


def tp(topic: str, partition: int = 0) -> TopicPartition:
    return TopicPartition(topic, partition)


REQ, HB = tp("requests"), tp("workers")


def policy(**kw) -> FetchWaitPolicy:
    return FetchWaitPolicy(active_ms=5, idle_ms=200, catch_up_ms=250, active_window_s=2.0, **kw)


def test_idle_until_records_arrive_then_fast_for_the_window():
    p = policy()
    assert p.wait_ms([(REQ, 10, 10)], now=100.0) == 200  # first sight of the watermark is no activity
    assert p.wait_ms([(REQ, 11, 11)], now=102.0) == 5  # a record arrived (and was read)
    assert p.wait_ms([(REQ, 11, 11)], now=103.9) == 5
    assert p.wait_ms([(REQ, 11, 11)], now=104.1) == 5  # window over: the wait doubles per quiet second
    assert p.wait_ms([(REQ, 11, 11)], now=107.0) == 40
    assert p.wait_ms([(REQ, 11, 11)], now=120.0) == 200  # ... up to idle_ms


def test_behind_the_watermark_waits_long_enough_to_assemble():
    p = policy()
    p.wait_ms([(REQ, 0, 0)], now=0.0)
    assert p.wait_ms([(REQ, 100, 5000)], now=0.1) == 250
    assert p.wait_ms([(REQ, 5000, 5000)], now=0.2) == 5  # caught up; records flowed


def test_a_partition_stuck_short_of_its_watermark_stops_counting_as_behind():
    p = policy()
    assert p.wait_ms([(REQ, 0, 1)], now=0.0) == 250
    assert p.wait_ms([(REQ, 0, 1)], now=4.9) == 250
    assert p.wait_ms([(REQ, 0, 1)], now=5.1) != 250  # position never moved: not worth waiting for
    assert p.wait_ms([(REQ, 1, 3)], now=6.0) == 250  # it moved: behind again


def test_unknown_positions_and_watermarks_are_ignored():
    p = policy()
    assert p.wait_ms([(REQ, None, None), (REQ, None, 7)], now=0.0) == 200


def test_only_hot_topics_count_as_activity():
    p = policy(hot={"requests"}.__contains__)
    p.wait_ms([(REQ, 0, 0), (HB, 0, 0)], now=0.0)
    assert p.wait_ms([(REQ, 0, 0), (HB, 3, 3)], now=100.0) == 200  # heartbeats only
    assert p.wait_ms([(REQ, 1, 1), (HB, 4, 4)], now=101.0) == 5


def test_wake_marks_activity():
    p = policy()
    p.wake(10.0)
    assert p.wait_ms([], now=11.0) == 5
    assert p.wait_ms([], now=13.0) == 10
    assert p.wait_ms([], now=60.0) == 200


def test_a_rung_consumer_parks_as_soon_as_its_window_passes():
    p = policy(rung=True)
    p.wait_ms([(REQ, 10, 10)], now=100.0)
    assert p.wait_ms([(REQ, 11, 11)], now=101.0) == 5  # a record: fast for the window
    assert p.wait_ms([(REQ, 11, 11)], now=102.9) == 5
    assert p.wait_ms([(REQ, 11, 11)], now=103.1) == 200  # no stepping up: its writers ring it
    assert p.wait_ms([(REQ, 100, 5000)], now=103.2) == 250  # behind still waits to assemble


def test_a_rung_policy_has_a_window_just_over_the_ring_gap():
    from kvflow.streams.doorbell import RING_GAP_S
    from kvflow.streams.kafka import RUNG_ACTIVE_WINDOW_S

    s = Settings(bootstrap_servers="x:1", fetch_active_window_s=2.0)
    p = fetch_wait_policy(s, rung=True)
    assert p.rung and RING_GAP_S < p.active_window_s == RUNG_ACTIVE_WINDOW_S < 2.0
    assert not fetch_wait_policy(s).rung and fetch_wait_policy(s).active_window_s == 2.0


def test_a_ring_marks_activity_on_a_consumer_that_is_not_parked(monkeypatch):
    from kvflow.streams import fetch_wait

    class Consumer:  # what woken() looks at: the assignment
        def assignment(self):
            return {tp("queue.aggregated", 2)}

    consumer, p = Consumer(), policy(rung=True)
    p.cut = lambda: pytest.fail("a consumer polling fast is not cut")
    monkeypatch.setattr(fetch_wait, "_local", {consumer: p})
    monkeypatch.setattr(fetch_wait.time, "monotonic", lambda: 50.0)
    assert p.wait_ms([], now=49.0) == 200  # window long over: it would park
    fetch_wait.woken("queue.aggregated", 2)  # rung while its last fast fetch was in flight
    assert p.wait_ms([], now=50.1) == 5  # the record it announces is fetched fast, not after a park


def test_settings_build_the_policy_and_only_for_the_embedded_broker():
    s = Settings(bootstrap_servers="x:1", fetch_max_wait_ms=7, fetch_idle_wait_ms=300, fetch_catch_up_wait_ms=400,
                 fetch_active_window_s=1.5)
    p = fetch_wait_policy(s, NOT_HOT)
    assert (p.active_ms, p.idle_ms, p.catch_up_ms, p.active_window_s) == (7, 300, 400, 1.5)
    assert fetch_wait_policy(s, idle_ms=100).idle_ms == 100 and fetch_wait_policy(s, idle_ms=900).idle_ms == 300
    assert adapt_fetch_wait(SimpleNamespace(_fetcher=SimpleNamespace()), s) is None  # real Kafka: none


def test_a_rung_consumer_parks_longer_than_one_no_writer_rings():
    s = Settings(bootstrap_servers="x:1", fetch_idle_wait_ms=300, fetch_rung_idle_wait_ms=900)
    assert fetch_wait_policy(s, rung=True).idle_ms == 900
    assert fetch_wait_policy(s).idle_ms == 300
    assert fetch_wait_policy(s, rung=True, idle_ms=500).idle_ms == 500


def test_an_idle_cap_bounds_only_the_quiet_wait():
    caps = iter([120, 30, 1000])
    p = policy(idle_cap=lambda: next(caps))
    p.wait_ms([(REQ, 10, 10)], now=100.0)  # quiet from the start: capped at 120 (below idle_ms 200)
    assert p.wait_ms([(REQ, 10, 10)], now=140.0) == 30
    assert p.wait_ms([(REQ, 10, 10)], now=141.0) == 200  # a cap above idle_ms does not raise it
    assert p.wait_ms([(REQ, 11, 11)], now=142.0) == 5  # active: the cap is not even asked
    assert p.wait_ms([(REQ, 100, 5000)], now=142.1) == 250  # nor when behind


def test_install_needs_a_started_consumer():
    with pytest.raises(RuntimeError):
        install(SimpleNamespace(), policy())
    wake(SimpleNamespace())  # no policy: no-op


async def test_fetcher_sends_the_policy_wait(kafka):
    """Against the real embedded broker: the fetch requests carry the policy's wait."""
    from aiokafka import TopicPartition
    from aiokafka.consumer.fetcher import Fetcher

    from kvflow.streams.kafka import make_consumer

    kafka_settings, catalog = kafka
    consumer = make_consumer(kafka_settings)
    await consumer.start()
    try:
        t = TopicPartition(catalog.requests.name, 0)
        consumer.assign([t])
        p = adapt_fetch_wait(consumer, kafka_settings)
        assert isinstance(p, FetchWaitPolicy)
        seen = []
        original = Fetcher._get_actions_per_node

        def spy(self, assignment):
            out = original(self, assignment)
            seen.extend(req._max_wait_ms for _, req in out[0])
            return out

        Fetcher._get_actions_per_node = spy
        try:
            await consumer.getmany(timeout_ms=500)
        finally:
            Fetcher._get_actions_per_node = original
        assert seen and set(seen) <= {p.idle_ms, p.catch_up_ms, p.active_ms}
    finally:
        await consumer.stop()


def test_a_wake_asks_for_a_cut_only_when_a_long_poll_is_in_flight():
    p = policy(cut_above_ms=50)
    assert p.wake(1.0) is False  # nothing sent yet
    p.sent_ms = 5
    assert p.wake(2.0) is False  # an active poll ends soon anyway
    p.sent_ms = 200
    assert p.wake(3.0) is True


@pytest.mark.parametrize("how", ["wake", "produced"])
async def test_a_parked_consumer_is_cut_short(kafka, waiter, how):
    """Against the real embedded broker: a consumer parked in a 20 s long poll
    gets a new record within 5 s once woken (the broker holds such a fetch
    for 10 s, its own cap, before answering)."""
    from aiokafka import TopicPartition

    from kvflow.streams.fetch_wait import produced
    from kvflow.streams.kafka import make_consumer, make_producer

    kafka_settings, catalog = kafka
    topic = catalog.requests.name
    consumer, producer = make_consumer(kafka_settings), make_producer(kafka_settings)
    await consumer.start()
    await producer.start()
    got: list = []

    async def read() -> None:
        while True:
            for records in (await consumer.getmany(timeout_ms=30_000)).values():
                got.extend(records)

    t = TopicPartition(topic, 0)
    consumer.assign([t])
    await consumer.seek_to_end(t)
    # Rung: it parks in its 20 s poll at once instead of stepping the wait up through ~20 s of quiet.
    p = install(consumer, FetchWaitPolicy(active_ms=10, idle_ms=20_000, active_window_s=0.0, rung=True))
    reader = asyncio.create_task(read())
    try:
        await waiter(lambda: p.sent_ms == 20_000 and consumer._fetcher._in_flight, timeout_s=120)
        await producer.send_and_wait(topic, b"x", partition=0)
        wake(consumer) if how == "wake" else produced(topic)
        await waiter(lambda: got, timeout_s=5)
        assert [r.value for r in got] == [b"x"]
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await producer.stop()
        await consumer.stop()


def test_a_catch_up_fetch_is_never_cut():
    p = policy(cut_above_ms=50)
    p.wait_ms([(REQ, 0, 0)], now=0.0)
    assert p.wait_ms([(REQ, 100, 5000)], now=0.1) == 250 and not p.quiet  # behind: the broker needs the time
    assert p.wait_ms([(REQ, 5000, 5000)], now=60.0) == 200 and p.quiet


async def test_a_cut_before_the_fetch_task_runs_does_not_stop_the_consumer(kafka, waiter):
    """A wake that lands between the fetch task's creation and its first step
    (a ring arriving as the fetch goes out) must not end aiokafka's fetch
    routine: the consumer still receives the next record."""
    import weakref

    from aiokafka import TopicPartition

    from kvflow.streams import fetch_wait
    from kvflow.streams.kafka import make_consumer, make_producer

    kafka_settings, catalog = kafka
    topic = catalog.requests.name
    consumer, producer = make_consumer(kafka_settings), make_producer(kafka_settings)
    await consumer.start()
    await producer.start()
    t = TopicPartition(topic, 0)
    consumer.assign([t])
    await consumer.seek_to_end(t)
    p = install(consumer, FetchWaitPolicy(active_ms=10, idle_ms=2_000, active_window_s=0.0))
    choose, early_cuts = p.wait_ms, []

    def wait_ms(partitions, now):  # schedule a cut that runs before the fetch task's first step
        if len(early_cuts) < 3:
            early_cuts.append(now)
            asyncio.get_running_loop().call_soon(fetch_wait._cut, weakref.ref(consumer))
        return choose(partitions, now)

    p.wait_ms = wait_ms
    got: list = []

    async def read() -> None:
        while True:
            for records in (await consumer.getmany(timeout_ms=30_000)).values():
                got.extend(records)

    reader = asyncio.create_task(read())
    try:
        await waiter(lambda: len(early_cuts) == 3, timeout_s=60)
        await producer.send_and_wait(topic, b"y", partition=0)
        await waiter(lambda: got, timeout_s=60)
        assert [r.value for r in got] == [b"y"]
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await producer.stop()
        await consumer.stop()


async def test_consumers_of_the_embedded_broker_tick_slowly_and_still_get_records(kafka, waiter):
    """The fetch routine's tick is FETCHER_TIMEOUT_MS, not aiokafka's 200 ms; a record
    written while the consumer is parked in an idle long poll, with no ring, still arrives."""
    from aiokafka import TopicPartition

    from kvflow.streams.kafka import make_consumer, make_producer
    from kvflow.streams.tansu_compat import FETCHER_TIMEOUT_MS

    kafka_settings, catalog = kafka
    consumer = make_consumer(kafka_settings)
    await consumer.start()
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        assert consumer._fetcher._fetcher_timeout == FETCHER_TIMEOUT_MS / 1000
        t = TopicPartition(catalog.metrics.name, 0)
        consumer.assign([t])
        await consumer.seek_to_end(t)
        p = adapt_fetch_wait(consumer, kafka_settings, NOT_HOT)
        assert p is not None
        got = []

        async def read() -> None:
            while not got:
                got.extend((await consumer.getmany(t, timeout_ms=1000)).get(t, []))

        reader = asyncio.create_task(read())
        await waiter(lambda: p.cut is not None and consumer._fetcher._in_flight, timeout_s=60)
        await producer.send_and_wait(t.topic, b"quiet", partition=0)
        await asyncio.wait_for(reader, 120)
        assert [r.value for r in got] == [b"quiet"]
    finally:
        await producer.stop()
        await consumer.stop()


async def test_an_offset_lookup_cuts_a_parked_fetch(kafka, waiter):
    """end_offsets / beginning_offsets share the connection of a fetch parked in a 30 s
    idle poll, which the broker answers first: the lookup cuts that fetch instead of
    waiting it out (a worker's start-up did, with a 30 s idle wait)."""
    from aiokafka import TopicPartition

    from kvflow.streams.kafka import make_consumer

    kafka_settings, catalog = kafka
    settings = kafka_settings.model_copy(update={"fetch_idle_wait_ms": 30_000, "fetch_rung_idle_wait_ms": 30_000,
                                                 "fetch_active_window_s": 0.1})
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        t = TopicPartition(catalog.control.name, 0)
        consumer.assign([t])
        await consumer.seek_to_end(t)
        p = adapt_fetch_wait(consumer, settings, NOT_HOT, rung=True)
        reader = asyncio.create_task(consumer.getmany(t, timeout_ms=60_000))
        await waiter(lambda: p.sent_ms == 30_000 and consumer._fetcher._in_flight, timeout_s=60)
        # Half the parked poll: only a cut lets the lookups through in time.
        ends = await asyncio.wait_for(consumer.end_offsets([t]), 15)
        starts = await asyncio.wait_for(consumer.beginning_offsets([t]), 15)
        assert ends[t] >= starts[t] >= 0
        reader.cancel()
    finally:
        await consumer.stop()


async def test_a_fetch_routine_that_finds_a_stale_in_flight_mark_looks_again_at_once(kafka, waiter):
    """The state a cut left on the router's request reader (docs/benchmarks.md, "Requests that
    waited 2 s on one hop"): its node still marked in flight with no fetch task running. The
    routine must look again at once, not sleep its tick; with a fetch really in flight, the
    tick stands."""
    from aiokafka import TopicPartition

    from kvflow.streams.fetch_wait import STALE_RECHECK_S
    from kvflow.streams.kafka import make_consumer
    from kvflow.streams.tansu_compat import FETCHER_TIMEOUT_MS

    kafka_settings, catalog = kafka
    consumer = make_consumer(kafka_settings)
    await consumer.start()
    try:
        t = TopicPartition(catalog.metrics.name, 0)
        consumer.assign([t])
        assert adapt_fetch_wait(consumer, kafka_settings) is not None
        fetcher = consumer._fetcher
        await waiter(lambda: fetcher._in_flight and any(not task.done() for task in fetcher._pending_tasks),
                     timeout_s=60)
        assignment = fetcher._subscriptions.subscription.assignment
        # No await from here to the end of the block: the fetch routine cannot run in between.
        assert fetcher._get_actions_per_node(assignment)[2] == FETCHER_TIMEOUT_MS / 1000  # a fetch in flight
        running, fetcher._pending_tasks = fetcher._pending_tasks, set()  # as if it had just ended
        try:
            fetches, _, timeout, _, _ = fetcher._get_actions_per_node(assignment)
        finally:
            fetcher._pending_tasks = running
        assert not fetches and timeout == STALE_RECHECK_S
    finally:
        await consumer.stop()
