-- kvflow metrics tables: one row per finished request, one per worker load snapshot.
--
-- Canonical copy. kvflow/data/clickhouse/ ships a byte-identical copy inside
-- the Python package (tests/test_planner_sink.py asserts they match), which
-- kvflow.planner.clickhouse.ensure_schema() runs at start-up. Table names are
-- unqualified: they land in the client's database ("default" for embedded
-- chDB, the database named in the URL for a ClickHouse server).
--
-- Retention: rows expire 7 days after they were *inserted*, not after their
-- event time, so replays on a simulated clock (ts near 1970) are kept.
-- Ingestion is done by the kvflow metrics sink (Kafka consumer + batched
-- inserts); there is deliberately no Kafka table engine here, because chDB
-- cannot run one and a failed CREATE leaves a file that breaks later opens.

CREATE TABLE IF NOT EXISTS request_metrics
(
    ts            DateTime64(3, 'UTC') COMMENT 'request finish time (RequestMetrics.ts_ms)',
    worker_id     LowCardinality(String),
    model         LowCardinality(String),
    request_id    String,
    isl           Int32 COMMENT 'input sequence length, tokens',
    osl           Int32 COMMENT 'output sequence length, tokens',
    ttft_ms       Float64,
    itl_ms        Float64 COMMENT 'mean inter-token latency of the request',
    e2e_ms        Float64,
    cached_tokens Int32 COMMENT 'prompt tokens served from the KV cache',
    ok            Bool,
    source        LowCardinality(String),
    inserted_at   DateTime DEFAULT now()
)
ENGINE = MergeTree
ORDER BY (worker_id, ts)
TTL inserted_at + INTERVAL 7 DAY;

CREATE TABLE IF NOT EXISTS worker_metrics
(
    ts                   DateTime64(3, 'UTC') COMMENT 'snapshot time (WorkerMetrics.ts_ms)',
    worker_id            LowCardinality(String),
    role                 LowCardinality(String),
    active_requests      Int32,
    waiting_requests     Int32,
    kv_used_blocks       Int32,
    kv_total_blocks      Int32,
    queue_depth          Int32,
    prefill_tokens_per_s Float64,
    decode_tokens_per_s  Float64,
    aborted_requests     Int32 DEFAULT 0 COMMENT 'requests aborted on a cancel since the previous snapshot',
    inserted_at          DateTime DEFAULT now()
)
ENGINE = MergeTree
ORDER BY (worker_id, ts)
TTL inserted_at + INTERVAL 7 DAY;

-- tables created before aborted_requests existed
ALTER TABLE worker_metrics ADD COLUMN IF NOT EXISTS aborted_requests Int32 DEFAULT 0 AFTER decode_tokens_per_s;
