"""The workers projection (kvflow.streams.workers): one fold of heartbeats for router, bridge and status."""

from __future__ import annotations

from kvflow.planner.loop import workers_topic_counter
from kvflow.router.table import RoutingTable, apply_heartbeat
from kvflow.schemas import WorkerHeartbeat, WorkerRole, WorkerStatus, encode, now_ms
from kvflow.streams.bridge.worker_registry import WorkerRegistry
from kvflow.streams.kafka import make_producer
from kvflow.streams.status import collect_status, render_status
from kvflow.streams.workers import Workers, WorkerView, read_workers


def hb(worker_id: str, ts_ms: int, *, status: WorkerStatus = WorkerStatus.serving, model: str = "m",
       role: WorkerRole = WorkerRole.aggregated, slot: int = 0, ttl_ms: int = 5_000, queue_topic: str = "q",
       **fields) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=role, model=model, engine="mocker", block_size=16,
                           kv_total_blocks=64, queue_topic=queue_topic, queue_partition=slot, status=status,
                           ts_ms=ts_ms, ttl_ms=ttl_ms, **fields)


HISTORY = [
    hb("w1", 1_000, tokenizer="/models/tiny", context_length=4096),
    hb("w2", 1_000, slot=1),
    hb("w2", 1_500, slot=1, status=WorkerStatus.draining),
    hb("w1", 900, tokenizer="stale"),  # older than the one held: ignored
    hb("w3", 1_000, slot=2),
    hb("w3", 1_200, slot=2, status=WorkerStatus.stopped),
    hb("w4", 100, slot=3, ttl_ms=500),  # silent past its TTL by 1_000
]


def test_the_fold_keeps_the_newest_view_and_drops_stopped_and_silent_workers():
    workers = Workers()
    taken = [workers.apply(h) for h in HISTORY]
    assert taken == [True, True, True, False, True, True, True]
    assert sorted(workers.views) == ["w1", "w2", "w4"]
    assert workers.expire(1_000) == ["w4"]
    assert [w.worker_id for w in workers.serving()] == ["w1"] and workers.serving("other") == []
    w1 = workers.views["w1"]
    assert (w1.tokenizer, w1.context_length, w1.last_seen_ms) == ("/models/tiny", 4096, 1_000)
    assert workers.views["w2"].status is WorkerStatus.draining
    assert workers.views["w1"] == WorkerView.from_heartbeat(HISTORY[0])


def test_router_table_and_bridge_registry_fold_heartbeats_the_same_way():
    table, registry, workers = RoutingTable(), WorkerRegistry(clock=lambda: 1_000), Workers()
    for h in HISTORY:
        apply_heartbeat(table, h)
        registry.apply(h)
        workers.apply(h)
    workers.expire(1_000)
    assert [w.worker_id for w in registry.live_workers()] == [w.worker_id for w in workers.serving()] == ["w1"]
    table.live.expire(1_000)
    assert table.workers == workers.views == registry.workers.views
    assert registry.tokenizer_spec("m") == "/models/tiny" and registry.context_length("m") == 4096


async def test_status_and_the_planner_read_the_projection_from_the_topic(kafka):
    settings, catalog = kafka
    now = now_ms()
    queue = catalog.queue(WorkerRole.aggregated).name
    producer = make_producer(settings)
    await producer.start()
    try:
        for h in HISTORY:
            # Live ones get a TTL a loaded machine cannot outlive between here and the last reader.
            ttl_ms = h.ttl_ms if h.worker_id == "w4" else 600_000
            fresh = h.model_copy(update={"ts_ms": now - 1_000 + h.ts_ms, "queue_topic": queue, "ttl_ms": ttl_ms})
            await producer.send_and_wait(catalog.workers.name, encode(fresh), key=h.worker_id.encode())
    finally:
        await producer.stop()

    workers = await read_workers(settings, catalog)
    assert sorted(workers.views) == ["w1", "w2"]  # w3 stopped, w4 silent past its TTL
    rows = await collect_status(settings)
    assert [(r["worker_id"], r["status"], r["queue_depth"]) for r in rows] == [("w1", "serving", 0),
                                                                               ("w2", "draining", 0)]
    assert "w2" in render_status(rows) and "draining" in render_status(rows)
    assert await workers_topic_counter(settings, catalog)() == {WorkerRole.aggregated: 1}
