"""The Faust router against the real embedded broker: routing table and routing."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deployment import wait_router_ready
from aiokafka import TopicPartition

from kvflow.router.app import build_router_app
from kvflow.schemas import (
    DeadLetter,
    FinalResponse,
    InferenceRequest,
    ReplyTo,
    ResponseEvent,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
    decode,
    encode,
    now_ms,
)
from kvflow.streams.kafka import make_consumer, make_producer


def heartbeat(catalog, worker_id, slot, status=WorkerStatus.serving, model="m", active=0, ts=None, ttl_ms=120_000):
    # A long TTL by default: on a loaded machine seconds can pass between a heartbeat and the decision.
    return WorkerHeartbeat(worker_id=worker_id, model=model, engine="mocker", block_size=16, kv_total_blocks=64,
                           queue_topic=catalog.queue(WorkerRole.aggregated).name, queue_partition=slot,
                           status=status, active_requests=active, ts_ms=ts or now_ms(), ttl_ms=ttl_ms)


@pytest.fixture
async def router(kafka):
    settings, catalog = kafka
    r = build_router_app(settings, catalog, policy="round_robin")
    await r.app.start()
    producer = make_producer(settings)
    await producer.start()
    await wait_router_ready(settings, catalog, producer)
    yield r, producer
    await producer.stop()
    await r.app.stop()


async def read_partition(settings, topic, partition, n, timeout_s=60.0):
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    consumer.assign([TopicPartition(topic, partition)])
    out = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(out) < n:
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    out.extend(records)
    finally:
        await consumer.stop()
    return out


async def test_table_tracks_registration_drain_and_expiry(kafka, router, waiter):
    settings, catalog = kafka
    r, producer = router
    await producer.send_and_wait(catalog.workers.name, encode(heartbeat(catalog, "w1", 1)), key=b"w1")
    await producer.send_and_wait(catalog.workers.name, encode(heartbeat(catalog, "w2", 2)), key=b"w2")
    await waiter(lambda: set(r.table.workers) == {"w1", "w2"})
    # draining workers stay in the table but are no candidates
    await producer.send_and_wait(catalog.workers.name,
                                 encode(heartbeat(catalog, "w2", 2, status=WorkerStatus.draining)), key=b"w2")
    await waiter(lambda: r.table.workers["w2"].status == WorkerStatus.draining)
    assert [w.worker_id for w in r.table.candidates("m", WorkerRole.aggregated)] == ["w1"]
    # a stopped record removes the worker
    await producer.send_and_wait(catalog.workers.name,
                                 encode(heartbeat(catalog, "w2", 2, status=WorkerStatus.stopped)), key=b"w2")
    await waiter(lambda: "w2" not in r.table.workers)
    # w1 announces a short TTL, then stops heartbeating: expired on the next routing decision after it
    short = heartbeat(catalog, "w1", 1, ts=max(now_ms(), r.table.workers["w1"].last_seen_ms + 1), ttl_ms=1500)
    await producer.send_and_wait(catalog.workers.name, encode(short), key=b"w1")
    await waiter(lambda: r.table.workers["w1"].ttl_ms == 1500)
    await waiter(lambda: now_ms() > short.ts_ms + short.ttl_ms, timeout_s=30)
    req = InferenceRequest(request_id="late", model="m", prompt="x",
                           reply_to=ReplyTo(topic=catalog.responses.name, partition=5))
    await producer.send_and_wait(catalog.requests.name, encode(req), key=b"late")
    [msg] = await read_partition(settings, catalog.responses.name, 5, 1)
    final = decode(ResponseEvent, msg.value)
    assert isinstance(final, FinalResponse) and final.error.status == 503
    assert "w1" not in r.table.workers


async def test_round_robin_routes_to_worker_partitions(kafka, router, waiter):
    settings, catalog = kafka
    r, producer = router
    for wid, slot in (("a", 3), ("b", 7)):
        await producer.send_and_wait(catalog.workers.name, encode(heartbeat(catalog, wid, slot)), key=wid.encode())
    await waiter(lambda: len(r.table.workers) == 2)
    for i in range(4):
        req = InferenceRequest(request_id=f"r{i}", model="m", prompt="x",
                               reply_to=ReplyTo(topic=catalog.responses.name, partition=0))
        await producer.send_and_wait(catalog.requests.name, encode(req), key=req.request_id.encode())
    queue = catalog.queue(WorkerRole.aggregated).name
    got3 = await read_partition(settings, queue, 3, 2)
    got7 = await read_partition(settings, queue, 7, 2)
    for msgs, wid in ((got3, "a"), (got7, "b")):
        decisions = [decode(InferenceRequest, m.value).routing for m in msgs]
        assert {d.worker_id for d in decisions} == {wid}
        assert all(d.policy == "round_robin" and d.router_id == r.router_id for d in decisions)


async def test_malformed_records_dead_lettered_router_survives(kafka, router, waiter):
    settings, catalog = kafka
    r, producer = router
    await producer.send_and_wait(catalog.requests.name, b"{not json", key=b"bad")
    await producer.send_and_wait(catalog.workers.name, b'{"worker_id": 5}', key=b"bad")
    dead = await read_partition(settings, catalog.dead_letter.name, 0, 2)
    letters = [decode(DeadLetter, m.value) for m in dead]
    assert {d.source_topic for d in letters} == {catalog.requests.name, catalog.workers.name}
    assert any(d.value == "{not json" for d in letters)
    # still routing afterwards
    await producer.send_and_wait(catalog.workers.name, encode(heartbeat(catalog, "ok", 1)), key=b"ok")
    await waiter(lambda: "ok" in r.table.workers)
    req = InferenceRequest(request_id="after", model="m", prompt="x",
                           reply_to=ReplyTo(topic=catalog.responses.name, partition=0))
    await producer.send_and_wait(catalog.requests.name, encode(req), key=b"after")
    [msg] = await read_partition(settings, catalog.queue(WorkerRole.aggregated).name, 1, 1)
    assert decode(InferenceRequest, msg.value).request_id == "after"


async def test_unknown_model_gets_503_reply(kafka, router):
    settings, catalog = kafka
    r, producer = router
    req = InferenceRequest(request_id="nomodel", model="ghost", prompt="x",
                           reply_to=ReplyTo(topic=catalog.responses.name, partition=9))
    await producer.send_and_wait(catalog.requests.name, encode(req), key=b"nomodel")
    [msg] = await read_partition(settings, catalog.responses.name, 9, 1)
    final = decode(ResponseEvent, msg.value)
    assert final.request_id == "nomodel" and final.error.code == "no_workers"


async def test_queue_mode_holds_requests_releases_them_and_drops_cancelled_ones(kafka, waiter):
    from kvflow.schemas import CancelReason, CancelRequest, DecisionOutcome, FinishReason
    from kvflow.streams.explain import read_decisions

    settings, catalog = kafka
    r = build_router_app(settings.model_copy(update={"shed_mode": "queue", "shed_kv_threshold": 0.5}), catalog,
                         policy="round_robin")
    await r.app.start()
    producer = make_producer(settings)
    await producer.start()
    try:
        # A long TTL: on a loaded machine the steps below can take longer than the usual 1.5 s.
        busy = heartbeat(catalog, "w1", 4).model_copy(update={"kv_used_blocks": 60, "ttl_ms": 120_000})  # 60/64 used
        await producer.send_and_wait(catalog.workers.name, encode(busy), key=b"w1")
        await waiter(lambda: "w1" in r.table.workers)
        for rid, partition in (("held", 2), ("gone", 3)):
            req = InferenceRequest(request_id=rid, model="m", prompt="x",
                                   reply_to=ReplyTo(topic=catalog.responses.name, partition=partition))
            await producer.send_and_wait(catalog.requests.name, encode(req), key=rid.encode())
        await waiter(lambda: r.counters["queued"] == 2 and len(r.queue) == 2)

        cancel = CancelRequest(request_id="gone", reason=CancelReason.client_cancelled, requested_by="client:0",
                               ts_ms=now_ms())
        await producer.send_and_wait(catalog.cancels.name, encode(cancel), key=b"gone")
        [msg] = await read_partition(settings, catalog.responses.name, 3, 1)
        final = decode(ResponseEvent, msg.value)
        assert final.request_id == "gone" and final.finish_reason is FinishReason.abort
        assert len(r.queue) == 1 and r.counters["queue_cancelled"] == 1

        # The worker's KV use dropped. A long TTL: on a loaded machine the router may read this
        # heartbeat, and tick, seconds after it.
        free = heartbeat(catalog, "w1", 4, ts=max(now_ms(), busy.ts_ms + 1)).model_copy(update={"ttl_ms": 120_000})
        await producer.send_and_wait(catalog.workers.name, encode(free), key=b"w1")
        [msg] = await read_partition(settings, catalog.queue(WorkerRole.aggregated).name, 4, 1)
        routed = decode(InferenceRequest, msg.value)
        assert routed.request_id == "held" and routed.routing.worker_id == "w1"
        assert r.counters["released"] == 1 and not r.queue
        outcomes: list = []
        for _ in range(20):  # decision records are sent without waiting for the broker's ack
            outcomes = [d.outcome for d in await read_decisions(settings, "held", catalog, idle_ms=300)]
            if len(outcomes) >= 2:
                break
        assert outcomes == [DecisionOutcome.queued, DecisionOutcome.routed]
    finally:
        await producer.stop()
        await r.app.stop()


async def test_priority_queue_displaces_the_low_class_and_records_the_serving_class(kafka, waiter):
    from kvflow.schemas import DecisionOutcome
    from kvflow.streams.explain import read_decisions

    settings, catalog = kafka
    update = {"shed_mode": "queue", "shed_kv_threshold": 0.5, "shed_queue_capacity": 1, "shed_queue_order": "priority"}
    r = build_router_app(settings.model_copy(update=update), catalog, policy="round_robin")
    await r.app.start()
    producer = make_producer(settings)
    await producer.start()
    try:
        busy = heartbeat(catalog, "w1", 5).model_copy(update={"kv_used_blocks": 60, "ttl_ms": 120_000})
        await producer.send_and_wait(catalog.workers.name, encode(busy), key=b"w1")
        await waiter(lambda: "w1" in r.table.workers)
        for rid, priority, partition in (("low", 0, 5), ("high", 2, 6)):
            req = InferenceRequest(request_id=rid, model="m", prompt="x", priority=priority, tenant="t-1",
                                   session_id="s-1",
                                   reply_to=ReplyTo(topic=catalog.responses.name, partition=partition))
            await producer.send_and_wait(catalog.requests.name, encode(req), key=rid.encode())
            await waiter(lambda rid=rid: r.counters["queued"] == (1 if rid == "low" else 2))
        [msg] = await read_partition(settings, catalog.responses.name, 5, 1)
        final = decode(ResponseEvent, msg.value)
        assert final.request_id == "low" and final.error.code == "overloaded" and final.error.status == 503
        assert r.counters["displaced"] == 1 and len(r.queue) == 1

        # A long TTL: on a loaded machine the router may read this heartbeat, and tick, seconds after it.
        free = heartbeat(catalog, "w1", 5, ts=max(now_ms(), busy.ts_ms + 1)).model_copy(update={"ttl_ms": 120_000})
        await producer.send_and_wait(catalog.workers.name, encode(free), key=b"w1")
        [msg] = await read_partition(settings, catalog.queue(WorkerRole.aggregated).name, 5, 1)
        routed = decode(InferenceRequest, msg.value)
        assert (routed.request_id, routed.priority, routed.tenant, routed.session_id) == ("high", 2, "t-1", "s-1")
        records: list = []
        for _ in range(20):  # decision records are sent without waiting for the broker's ack
            records = await read_decisions(settings, "high", catalog, idle_ms=300)
            if len(records) >= 2:
                break
        assert [d.outcome for d in records] == [DecisionOutcome.queued, DecisionOutcome.routed]
        assert all(d.priority == 2 and d.tenant == "t-1" for d in records)
    finally:
        await producer.stop()
        await r.app.stop()


async def test_pool_grid_routes_long_prompts_to_the_long_context_pool(kafka, waiter, tmp_path):
    from pathlib import Path

    from kvflow.streams.explain import read_decisions

    settings, catalog = kafka
    grid = Path(__file__).resolve().parents[1] / "examples" / "pools.toml"
    r = build_router_app(settings.model_copy(update={"router_pool_grid": str(grid)}), catalog,
                         policy="least_loaded")
    await r.app.start()
    producer = make_producer(settings)
    await producer.start()
    try:
        for wid, slot, pool in (("ll", 7, "low-latency"), ("lc", 8, "long-context")):
            hb = heartbeat(catalog, wid, slot).model_copy(update={"pool": pool, "ttl_ms": 120_000})
            await producer.send_and_wait(catalog.workers.name, encode(hb), key=wid.encode())
        await waiter(lambda: {"ll", "lc"} <= set(r.table.workers))
        for rid, isl in (("short", 100), ("long", 9_000)):
            req = InferenceRequest(request_id=rid, model="m", token_ids=list(range(isl)),
                                   reply_to=ReplyTo(topic=catalog.responses.name, partition=0))
            await producer.send_and_wait(catalog.requests.name, encode(req), key=rid.encode())
        queue = catalog.queue(WorkerRole.aggregated).name
        [short] = await read_partition(settings, queue, 7, 1)
        [long] = await read_partition(settings, queue, 8, 1)
        assert decode(InferenceRequest, short.value).request_id == "short"
        assert decode(InferenceRequest, long.value).request_id == "long"
        records: list = []
        for _ in range(20):  # decision records are sent without waiting for the broker's ack
            records = await read_decisions(settings, "long", catalog, idle_ms=300)
            if records:
                break
        assert (records[0].prefill_pool, records[0].decode_pool) == ("long-context", "long-context")
    finally:
        await producer.stop()
        await r.app.stop()


def test_a_router_apps_faust_directory_goes_with_its_process(tmp_path):
    code = ("from kvflow.settings import Settings; from kvflow.router.app import build_router_app; "
            "apps = [build_router_app(Settings(bootstrap_servers='127.0.0.1:1')) for _ in range(2)]; "
            "import os; assert all(os.path.isdir(a.app.conf.datadir) for a in apps); "
            "print(*(a.app.conf.datadir for a in apps))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    dirs = [Path(p) for p in out.stdout.split()]
    assert len(dirs) == 2 and all(p.parent == tmp_path and p.name.startswith("kvflow-router-") for p in dirs)
    assert not any(p.exists() for p in dirs)


async def test_the_request_reader_parks_when_quiet_and_a_ring_cuts_its_poll(kafka, waiter):
    """Every bridge and KvflowClient rings the router with its requests, so once they
    stop, the router's request consumer parks in its idle poll at once (30 s here)
    instead of stepping its wait up; a request sent as KvflowClient sends it (record,
    then ``produced``) is routed long before that poll would end."""
    from kvflow.streams import fetch_wait

    settings, catalog = kafka
    settings = settings.model_copy(update={"fetch_idle_wait_ms": 30_000, "fetch_rung_idle_wait_ms": 30_000})
    r = build_router_app(settings, catalog, policy="round_robin")
    await r.app.start()
    producer = make_producer(settings)
    await producer.start()
    try:
        await wait_router_ready(settings, catalog, producer)
        [policy] = [p for p in list(fetch_wait._local.values()) if p.hot is not None and p.hot(catalog.requests.name)]
        assert policy.rung and policy.idle_ms == 30_000
        await producer.send_and_wait(catalog.workers.name, encode(heartbeat(catalog, "w", 4)), key=b"w")
        await waiter(lambda: "w" in r.table.workers)
        await waiter(lambda: policy.sent_ms == 30_000, timeout_s=20)  # parked in a 30 s poll
        req = InferenceRequest(request_id="after-quiet", model="m", prompt="x",
                               reply_to=ReplyTo(topic=catalog.responses.name, partition=0))
        await producer.send_and_wait(catalog.requests.name, encode(req), key=b"after-quiet")
        fetch_wait.produced(catalog.requests.name)
        [routed] = await read_partition(settings, catalog.queue(WorkerRole.aggregated).name, 4, 1, timeout_s=20)
        assert decode(InferenceRequest, routed.value).request_id == "after-quiet"
    finally:
        await producer.stop()
        await r.app.stop()
