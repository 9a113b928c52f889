"""Metrics sink and planner queries against a real embedded chDB (one directory per test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.planner.clickhouse import SchemaError, ensure_schema, open_client, schema_files, schema_statements
from kvflow.planner.queries import interval_aggregates, request_rate_series, worker_aggregates
from kvflow.planner.sink import MetricsSink
from kvflow.schemas.metrics import RequestMetrics, WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000_000  # event time; retention counts from insert time, so old event times are kept


@pytest.fixture
def ch(tmp_path):
    client = open_client(data_dir=tmp_path / "ch")
    ensure_schema(client)
    yield client
    client.close()  # chDB pins one directory per process until closed


def req(dt_ms, worker, isl, osl, ttft, itl, cached=0, ok=True, model="m", rid=None) -> RequestMetrics:
    return RequestMetrics(ts_ms=T0 + dt_ms, request_id=rid or f"{worker}-{dt_ms}", model=model, worker_id=worker,
                          isl=isl, osl=osl, ttft_ms=ttft, itl_ms=itl, e2e_ms=ttft + itl * osl, cached_tokens=cached,
                          ok=ok)


def snap(dt_ms, worker, active, used, total=1000, role="decode", prefill_tps=0.0) -> WorkerMetrics:
    return WorkerMetrics(ts_ms=T0 + dt_ms, worker_id=worker, role=role, active_requests=active, waiting_requests=1,
                         kv_used_blocks=used, kv_total_blocks=total, prefill_tokens_per_s=prefill_tps)


ROWS = [
    req(0, "w1", 100, 10, 50, 5),
    req(2000, "w1", 200, 20, 150, 15, cached=100),
    req(3000, "w3", 1000, 100, 1000, 100, model="other"),
    req(5000, "w2", 300, 1, 250, 0),  # one output token: no ITL
    req(9999, "w2", 400, 30, 9999, 999, cached=200, ok=False),
    req(-100_000, "w1", 10_000, 10_000, 1e6, 1e6),  # outside every window
    req(10_000, "w2", 10_000, 10_000, 1e6, 1e6),  # at t1: windows are half-open
    snap(-100_000, "w1", 99, 1000),  # outside the 60 s window
    snap(1000, "w1", 3, 100, prefill_tps=1000.0),
    snap(6000, "w1", 5, 300, prefill_tps=3000.0),
    snap(7000, "w4", 2, 50, role="prefill"),
]


def test_packaged_ddl_is_the_infra_ddl():
    infra = {p.name: p.read_bytes() for p in (ROOT / "infra" / "clickhouse").glob("*.sql")}
    packaged = {f.name: f.read_bytes() for f in schema_files()}
    assert infra and packaged == infra


def test_kafka_table_engine_is_refused():
    with pytest.raises(SchemaError, match="Kafka"):
        schema_statements("CREATE TABLE q (v String) ENGINE = Kafka SETTINGS kafka_broker_list = 'x';")


def test_schema_is_idempotent_mergetree_ordered_by_worker_and_time(ch):
    assert len(ensure_schema(ch)) == 3  # second run: IF NOT EXISTS everywhere, no error
    rows = ch.query("SELECT name, engine, sorting_key FROM system.tables "
                    "WHERE database = currentDatabase() ORDER BY name").result_rows
    assert rows == [("request_metrics", "MergeTree", "worker_id, ts"), ("worker_metrics", "MergeTree", "worker_id, ts")]


def test_interval_aggregates_match_hand_computation(ch):
    MetricsSink(ch).write(ROWS)
    a = interval_aggregates(ch, T0, T0 + 10_000, model="m")
    assert (a.num_requests, a.num_failed) == (4, 1)
    assert (a.mean_isl, a.mean_osl, a.mean_cached_tokens) == (250, 15.25, 75)
    # TTFT over ok requests [50, 150, 250]; p99 = 150 + 0.98 * (250 - 150)
    assert (a.mean_ttft_ms, a.p50_ttft_ms) == (150, 150) and a.p99_ttft_ms == pytest.approx(248)
    # ITL over ok requests with osl > 1: [5, 15]; p99 = 5 + 0.99 * 10
    assert (a.mean_itl_ms, a.p50_itl_ms) == (10, 10) and a.p99_itl_ms == pytest.approx(14.9)
    assert a.request_rate_per_s == pytest.approx(0.4)
    obs = a.to_observation()
    assert (obs.duration_s, obs.num_requests, obs.mean_ttft_ms, obs.mean_itl_ms) == (10, 4, 150, 10)
    assert (obs.p99_ttft_ms, obs.p99_itl_ms) == (a.p99_ttft_ms, a.p99_itl_ms)

    everything = interval_aggregates(ch, T0, T0 + 10_000)
    assert everything.num_requests == 5 and everything.mean_isl == 400  # (100+200+1000+300+400) / 5
    assert (everything.ttft_over_target, everything.itl_over_target) == (None, None)
    over = interval_aggregates(ch, T0, T0 + 10_000, model="m", ttft_target_ms=100, itl_target_ms=10)
    assert (over.ttft_over_target, over.itl_over_target) == (2, 1)  # TTFT 150 and 250; ITL 15


def test_empty_window_has_no_statistics(ch):
    MetricsSink(ch).write(ROWS)
    a = interval_aggregates(ch, T0 + 20_000, T0 + 30_000)
    assert (a.num_requests, a.num_failed, a.mean_isl, a.p99_ttft_ms, a.mean_itl_ms) == (0, 0, None, None, None)
    assert a.to_observation().request_rate_per_s == 0
    with pytest.raises(ValueError):
        interval_aggregates(ch, T0, T0)


def test_worker_aggregates_join_requests_and_snapshots(ch):
    MetricsSink(ch).write(ROWS)
    by_id = {w.worker_id: w for w in worker_aggregates(ch, now_ms=T0 + 10_000, window_s=60)}
    assert sorted(by_id) == ["w1", "w2", "w3", "w4"]
    w1 = by_id["w1"]
    assert (w1.num_requests, w1.mean_ttft_ms, w1.mean_itl_ms) == (2, 100, 10)
    assert w1.p99_ttft_ms == pytest.approx(149) and w1.p99_itl_ms == pytest.approx(14.9)
    assert (w1.num_snapshots, w1.role, w1.last_ts_ms) == (2, "decode", T0 + 6000)
    assert (w1.last_active_requests, w1.last_kv_used_blocks, w1.last_kv_total_blocks) == (5, 300, 1000)
    assert w1.mean_kv_usage == pytest.approx(0.2) and w1.mean_prefill_tokens_per_s == 2000
    w2 = by_id["w2"]  # one ok request with a single output token, one failure
    assert (w2.num_requests, w2.mean_ttft_ms, w2.mean_itl_ms, w2.num_snapshots, w2.role) == (2, 250, None, 0, None)
    w4 = by_id["w4"]  # snapshots only
    assert (w4.num_requests, w4.mean_ttft_ms, w4.role, w4.last_active_requests) == (0, None, "prefill", 2)


def test_request_rate_series_bins_and_fills_gaps(ch):
    MetricsSink(ch).write(ROWS)
    s = request_rate_series(ch, T0, T0 + 10_000, bin_s=2)
    assert s.bin_start_ms == tuple(T0 + i * 2000 for i in range(5))
    assert s.num_requests == (1, 2, 1, 0, 1)
    assert s.mean_isl == (100, 600, 300, None, 400)
    assert s.rate_per_s == (0.5, 1.0, 0.5, 0.0, 0.5)
    partial = request_rate_series(ch, T0, T0 + 10_000, bin_s=4, model="m")
    assert partial.num_requests == (2, 1, 1)
    assert partial.rate_per_s == (0.5, 0.25, 0.5)  # the last bin is 2 s long


def test_sink_flushes_by_row_count_and_by_age(ch):
    now = [0.0]
    sink = MetricsSink(ch, batch_rows=3, flush_interval_s=5, clock=lambda: now[0])
    count = lambda: ch.query("SELECT count() FROM request_metrics").result_rows[0][0]  # noqa: E731
    assert sink.add(ROWS[:2]) == 0 and sink.pending == 2 and count() == 0
    now[0] = 4.9
    assert sink.flush_if_due() == 0
    now[0] = 5.0
    assert sink.flush_if_due() == 2 and sink.pending == 0 and count() == 2
    assert sink.add(ROWS[2:5]) == 3 and count() == 5  # batch_rows reached inside add
    assert sink.flush() == 0 and sink.rows_written == 5


def test_sink_rejects_other_records(ch):
    with pytest.raises(TypeError, match="RequestMetrics or WorkerMetrics"):
        MetricsSink(ch).add([{"ts_ms": 1}])


def test_rows_survive_reopening_the_directory(tmp_path):
    client = open_client(data_dir=tmp_path / "ch")
    ensure_schema(client)
    MetricsSink(client).write(ROWS)
    client.close()
    client = open_client(data_dir=tmp_path / "ch")
    try:
        assert client.query("SELECT count() FROM request_metrics").result_rows[0][0] == 7
        assert client.query("SELECT count() FROM worker_metrics").result_rows[0][0] == 4
    finally:
        client.close()


def test_bulk_insert_is_one_columnar_batch(ch):
    n = 200_000
    rows = [RequestMetrics.model_construct(
        type="request", schema_version=1, ts_ms=T0 + i, request_id=f"r{i}", model="m", worker_id=f"w{i % 8}",
        isl=i % 1000, osl=10, ttft_ms=1.0, itl_ms=2.0, e2e_ms=3.0, cached_tokens=0, ok=True, source="bench")
        for i in range(n)]
    assert MetricsSink(ch).write(rows) == n
    total, isl_sum = ch.query("SELECT count(), sum(isl) FROM request_metrics").result_rows[0]
    assert (total, isl_sum) == (n, sum(i % 1000 for i in range(n)))


def test_schema_upgrades_a_worker_table_made_before_aborted_requests(tmp_path):
    client = open_client(data_dir=tmp_path / "old")
    try:
        client.command("CREATE TABLE worker_metrics (ts DateTime64(3, 'UTC'), worker_id LowCardinality(String), "
                       "role LowCardinality(String), active_requests Int32, waiting_requests Int32, "
                       "kv_used_blocks Int32, kv_total_blocks Int32, queue_depth Int32, "
                       "prefill_tokens_per_s Float64, decode_tokens_per_s Float64, inserted_at DateTime DEFAULT now()) "
                       "ENGINE = MergeTree ORDER BY (worker_id, ts)")
        client.command("INSERT INTO worker_metrics (ts, worker_id, role, active_requests, waiting_requests, "
                       "kv_used_blocks, kv_total_blocks, queue_depth, prefill_tokens_per_s, decode_tokens_per_s) "
                       "VALUES (now64(3), 'old', 'decode', 1, 0, 1, 10, 0, 0, 0)")
        ensure_schema(client)
        snapshot = snap(0, "w1", 1, 10).model_copy(update={"aborted_requests": 2})
        MetricsSink(client).write([snapshot])
        rows = client.query("SELECT worker_id, aborted_requests FROM worker_metrics ORDER BY worker_id").result_rows
        assert rows == [("old", 0), ("w1", 2)]
    finally:
        client.close()
