"""The live planner on the real embedded broker and a real chDB: sink service and planner loop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from aiokafka import TopicPartition
from clickhouse_connect.driver.exceptions import DatabaseError

from kvflow.planner.core import (
    PlannerConfig,
    PlannerMode,
    TickInput,
    TrafficObservation,
    initial_state,
    on_tick,
)
from kvflow.planner.interpolation import PerfModel
from kvflow.planner.loop import PlannerLoop, load_profile
from kvflow.planner.prometheus import planner_registry
from kvflow.planner.service import ClickHouseLocked, open_shared_clickhouse
from kvflow.planner.sink_service import SinkService, sink_group
from kvflow.schemas import DeadLetter, RequestMetrics, ScalingCommand, WorkerMetrics, WorkerRole, decode, encode
from kvflow.streams.kafka import make_consumer, make_producer

T0 = 1_700_000_000_000  # records' own clock; windows are on it, not on the wall clock
AGG = WorkerRole.aggregated


@pytest.fixture
async def clickhouse(kafka, tmp_path):
    settings, _ = kafka
    ch = await open_shared_clickhouse(settings, tmp_path / "chdb")
    yield ch
    ch.close()  # chDB pins one directory per process until closed


def request(i: int, ts_ms: int, isl: int = 2000, osl: int = 300, ttft: float = 200.0, itl: float = 30.0,
            worker: str = "w0") -> RequestMetrics:
    return RequestMetrics(ts_ms=ts_ms, request_id=f"r{i}-{ts_ms}", model="m", worker_id=worker, isl=isl, osl=osl,
                          ttft_ms=ttft, itl_ms=itl, e2e_ms=ttft + itl * osl)


def snapshot(i: int, worker: str = "w0") -> WorkerMetrics:
    return WorkerMetrics(ts_ms=T0 + i * 1000, worker_id=worker, role="aggregated", active_requests=i,
                         waiting_requests=0, kv_used_blocks=10 * i, kv_total_blocks=1000)


async def produce(settings, topic: str, values: list[bytes], keys: list[bytes]) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for value, key in zip(values, keys):
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


async def read_all(settings, topic: str, partitions: int, idle_ms: int = 500) -> list:
    consumer = make_consumer(settings, fetch_max_wait_ms=50)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out = []
        while batches := await consumer.getmany(timeout_ms=idle_ms):
            for records in batches.values():
                out.extend(records)
        return out
    finally:
        await consumer.stop()


async def committed_total(settings, catalog) -> int:
    """Sum over metrics partitions of the sink group's committed offsets (0 where none)."""
    consumer = make_consumer(settings, group_id=sink_group(settings), enable_auto_commit=False)
    await consumer.start()
    try:
        offsets = [await consumer.committed(TopicPartition(catalog.metrics.name, p))
                   for p in range(catalog.metrics.partitions)]
        return sum(o or 0 for o in offsets)
    finally:
        await consumer.stop()


async def count_rows(ch, table: str) -> int:
    return await ch.run(lambda: int(ch.client.query(f"SELECT count() FROM {table}").result_rows[0][0]))


async def test_sink_writes_metrics_and_dead_letters_malformed(kafka, clickhouse, waiter):
    settings, catalog = kafka
    good = [request(i, T0 + i) for i in range(5)] + [snapshot(i, worker=f"w{i}") for i in range(3)]
    bad = [b"not json", b'{"type": "request", "ts_ms": "soon"}', b'{"type": "gpu", "ts_ms": 1}']
    values = [encode(r) for r in good[:4]] + bad + [encode(r) for r in good[4:]]
    keys = [f"k{i}".encode() for i in range(len(values))]  # spread over partitions
    sink = SinkService(settings, catalog, clickhouse, flush_interval_s=0.2)
    await sink.start()
    try:
        await produce(settings, catalog.metrics.name, values, keys)
        await waiter(lambda: sink.rows_written == len(good), timeout_s=20)
        ids = await clickhouse.run(lambda: {r[0] for r in clickhouse.client.query(
            "SELECT request_id FROM request_metrics").result_rows})
        assert ids == {r.request_id for r in good if isinstance(r, RequestMetrics)}
        assert await count_rows(clickhouse, "worker_metrics") == 3
        # Every record, dead-lettered ones included, is committed once its batch is flushed.
        for _ in range(50):
            if await committed_total(settings, catalog) == len(values):
                break
            await asyncio.sleep(0.1)
        assert await committed_total(settings, catalog) == len(values)
    finally:
        await sink.stop()
    letters = [decode(DeadLetter, m.value) for m in await read_all(settings, catalog.dead_letter.name, 1)]
    assert sorted(d.value.encode() for d in letters) == sorted(bad)
    assert {(d.source_topic, d.consumer) for d in letters} == {(catalog.metrics.name, "planner-sink")}
    assert sink.dlq.count == len(bad)


class FlakyInserts:
    """The real client, except that inserts fail while ``failing`` is set."""

    def __init__(self, client) -> None:
        self._client = client
        self.failing = True
        self.failed = 0

    def insert_arrow(self, *args, **kwargs):
        if self.failing:
            self.failed += 1
            raise DatabaseError("injected insert failure")
        return self._client.insert_arrow(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


async def test_offsets_are_committed_only_after_a_successful_flush(kafka, clickhouse, waiter):
    settings, catalog = kafka
    flaky = FlakyInserts(clickhouse.client)
    sink = SinkService(settings, catalog, dataclasses.replace(clickhouse, client=flaky), flush_interval_s=0.1)
    await sink.start()
    first = [request(i, T0 + i) for i in range(3)]
    try:
        await produce(settings, catalog.metrics.name, [encode(r) for r in first], [b"a", b"b", b"c"])
        await waiter(lambda: sink.flush_failures >= 2 and sink.pending == 3, timeout_s=20)
        assert await committed_total(settings, catalog) == 0
        assert await count_rows(clickhouse, "request_metrics") == 0
        flaky.failing = False
        await waiter(lambda: sink.rows_written == 3, timeout_s=20)
    finally:
        await sink.stop()
    assert await committed_total(settings, catalog) == 3

    # A restarted sink resumes after the committed offsets: nothing is inserted twice.
    later = [request(10 + i, T0 + 100 + i) for i in range(2)]
    await produce(settings, catalog.metrics.name, [encode(r) for r in later], [b"d", b"e"])
    again = SinkService(settings, catalog, clickhouse, flush_interval_s=0.1)
    await again.start()
    try:
        await waiter(lambda: again.rows_written == 2, timeout_s=20)
    finally:
        await again.stop()
    assert await count_rows(clickhouse, "request_metrics") == 5


async def test_second_process_cannot_take_the_chdb_directory(kafka, clickhouse, tmp_path):
    settings, _ = kafka
    # Same process, same directory: the lock file refuses a second owner before chDB is touched.
    with pytest.raises(ClickHouseLocked):
        await open_shared_clickhouse(settings, tmp_path / "chdb")


async def test_planner_loop_reads_the_window_and_publishes_a_scaling_command(kafka, clickhouse, waiter):
    settings, catalog = kafka
    config = PlannerConfig(ttft_ms=500, itl_ms=50, adjustment_interval_s=10, mode=PlannerMode.aggregated,
                           max_gpus=8)
    profile = load_profile(None)
    # 50 req/s for 10 s at ISL 2000 / OSL 300 inside the window, plus rows outside it on both sides.
    inside = [request(i, T0 + i * 20, ttft=200 + i % 5, itl=30) for i in range(500)]
    before = [request(1000 + i, T0 - 5_000 + i, isl=99_999, osl=9_999) for i in range(7)]
    after = [request(2000 + i, T0 + 10_000 + i * 100, isl=500, osl=50, ttft=80, itl=10) for i in range(30)]
    sink = SinkService(settings, catalog, clickhouse, flush_interval_s=0.2)
    await sink.start()
    loop = PlannerLoop(settings, catalog, clickhouse, config, profile, lambda: {AGG: 1}, settle_s=1.0,
                       before_query=sink.flush)
    await loop.start(run=False)
    try:
        rows = inside + before + after
        await produce(settings, catalog.metrics.name, [encode(r) for r in rows], [r.worker_id.encode() for r in rows])
        await waiter(lambda: sink.rows_written + sink.pending == len(rows), timeout_s=30)

        report = await loop.tick(T0 + 10_000 + 1_000)  # window [T0, T0 + 10 s): settle_s before the tick
        agg = report.aggregates
        assert (agg.t0_ms, agg.t1_ms, agg.num_requests) == (T0, T0 + 10_000, 500)
        assert (agg.mean_isl, agg.mean_osl, agg.mean_itl_ms) == (2000, 300, 30)
        assert agg.mean_ttft_ms == pytest.approx(sum(r.ttft_ms for r in inside) / 500)

        # The core, fed the same traffic by hand, decides what the loop published.
        expected_state, expected = on_tick(
            initial_state(config, PerfModel.from_profile(profile)),
            TickInput(now_ms=T0 + 11_000, current_replicas={AGG: 1}, traffic=TrafficObservation(
                duration_s=10, num_requests=500, mean_isl=2000, mean_osl=300, mean_ttft_ms=agg.mean_ttft_ms,
                mean_itl_ms=30, mean_cached_tokens=0)))
        target = expected.target(AGG)
        assert target > 1, "the test load must call for a scale-up"
        assert [(c.pool, c.current_replicas, c.target_replicas) for c in report.commands] == [(AGG, 1, target)]
        published = await read_all(settings, catalog.scaling.name, 1)
        assert [(m.key, decode(ScalingCommand, m.value)) for m in published] == [(b"aggregated", report.commands[0])]

        # Its Prometheus series show the same tick: target, prediction, observed latency.
        scrape = {(m.name, tuple(sorted(m.labels.items()))): m.value
                  for family in planner_registry(loop).collect() for m in family.samples}
        assert scrape[("kvflow_planner_replicas", (("kind", "target"), ("pool", "aggregated")))] == target
        assert scrape[("kvflow_planner_replicas", (("kind", "current"), ("pool", "aggregated")))] == 1
        assert scrape[("kvflow_planner_predicted_requests_per_second", ())] == pytest.approx(50)
        assert scrape[("kvflow_planner_observed_latency_seconds", (("metric", "itl"), ("statistic", "mean")))] \
            == pytest.approx(0.030)
        assert scrape[("kvflow_planner_sla_ttft_seconds", ())] == 0.5

        # The next window starts where the last one ended: only the 30 later rows.
        second = await loop.tick(T0 + 15_000 + 1_000)
        assert (second.aggregates.t0_ms, second.aggregates.t1_ms) == (T0 + 10_000, T0 + 15_000)
        assert (second.aggregates.num_requests, second.aggregates.mean_isl) == (30, 500)
        assert loop.num_ticks == 2 == expected_state.num_ticks + 1
    finally:
        await loop.stop()
        await sink.stop()


async def test_planner_loop_ticks_on_its_own_and_survives_a_failed_query(kafka, clickhouse, waiter):
    settings, catalog = kafka
    config = PlannerConfig(adjustment_interval_s=0.2, mode=PlannerMode.aggregated, max_gpus=4)
    calls = {"n": 0}

    async def flaky_flush() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise DatabaseError("injected query failure")

    loop = PlannerLoop(settings, catalog, clickhouse, config, load_profile(None), lambda: {AGG: 3},
                       settle_s=0.0, before_query=flaky_flush)
    await loop.start()
    try:
        await waiter(lambda: loop.num_ticks >= 3, timeout_s=10)
    finally:
        await loop.stop()
    assert loop.failed_ticks == 1
    # No traffic: the first tick holds 3 (scale-down waits scale_down_hold_intervals), nothing published yet.
    assert loop.reports[0].commands == ()
    assert loop.reports[0].aggregates.num_requests == 0
    # Windows stay contiguous across the failed tick.
    for a, b in zip(loop.reports, loop.reports[1:]):
        assert b.aggregates.t0_ms == a.aggregates.t1_ms


async def test_fast_check_scales_up_between_ticks_on_fresh_latency(kafka, clickhouse, waiter):
    settings, catalog = kafka
    config = PlannerConfig(ttft_ms=500, itl_ms=50, adjustment_interval_s=60, mode=PlannerMode.aggregated,
                           max_gpus=8, reactive_window_s=5)
    sink = SinkService(settings, catalog, clickhouse, flush_interval_s=0.2)
    await sink.start()
    loop = PlannerLoop(settings, catalog, clickhouse, config, load_profile(None), lambda: {AGG: 1}, settle_s=1.0,
                       before_query=sink.flush, fast_interval_s=1.0)
    await loop.start(run=False)
    try:
        calm = [request(i, T0 + i * 50, isl=500, osl=50, ttft=100, itl=10) for i in range(80)]  # 20 req/s
        late = [request(100 + i, T0 + 10_000 + i * 50, isl=500, osl=50, ttft=2_000, itl=10) for i in range(80)]
        rows = calm + late
        await produce(settings, catalog.metrics.name, [encode(r) for r in rows], [r.worker_id.encode() for r in rows])
        await waiter(lambda: sink.rows_written + sink.pending == len(rows), timeout_s=30)

        assert await loop.fast_check(T0 + 5_000) == ()  # [T0, T0 + 4 s): light load, TTFT fine
        commands = await loop.fast_check(T0 + 15_000)  # [T0 + 9 s, T0 + 14 s): TTFT p99 2 s > 500 ms
        assert [(c.pool, c.current_replicas, c.target_replicas) for c in commands] == [(AGG, 1, 2)]
        # the window's requests over the TTFT target, counted in ClickHouse, are the pressure
        assert "reactive scale up 1 -> 2" in commands[0].reason
        assert "80 of 80 finished requests over TTFT target 500 ms" in commands[0].reason
        assert loop.state.targets[AGG] == 2 and loop.num_ticks == 0  # raised between ticks
        published = await read_all(settings, catalog.scaling.name, 1)
        assert [decode(ScalingCommand, m.value) for m in published] == list(commands)
        # one step per start-up time: a second check right after adds nothing
        assert await loop.fast_check(T0 + 16_000) == ()
    finally:
        await loop.stop()
        await sink.stop()
