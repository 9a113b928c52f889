"""KV-aware routing through the real embedded broker: replicas that agree,
a restarted router that rebuilds the same index, and prefix reuse end to end."""

import asyncio

import httpx
import pytest
from deployment import wait_router_ready
from aiokafka import TopicPartition

from kvflow.router.app import build_router_app
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.router.inflight import kv_lagging
from kvflow.schemas import (
    BlockRemoved,
    BlockStored,
    DeadLetter,
    InferenceRequest,
    KvEventBatch,
    ReplyTo,
    WorkerHeartbeat,
    WorkerRole,
    decode,
    decode_kv_frame,
    encode,
    now_ms,
)
from kvflow.streams.broker import free_port
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.supervisor import Supervisor, WorkerSpec
from deployment import steady, wait_bridge_healthy

BS = 16
MODEL = "m"


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 10 for i in range(n)]


async def publish_state(producer, catalog, worker_slots: dict[str, int], stored: dict[str, list[list[int]]]):
    for wid, slot in worker_slots.items():
        hb = WorkerHeartbeat(worker_id=wid, model=MODEL, engine="mocker", block_size=BS, kv_total_blocks=1000,
                             queue_topic=catalog.queue(WorkerRole.aggregated).name, queue_partition=slot,
                             ts_ms=now_ms(), ttl_ms=600_000, started_ms=1)
        await producer.send_and_wait(catalog.workers.name, encode(hb), key=wid.encode())
    for wid, prompts in stored.items():
        for event_id, prompt in enumerate(prompts):
            batch = KvEventBatch(worker_id=wid, event_id=event_id, block_size=BS, ts_ms=now_ms(),
                                 events=[BlockStored(block_hashes=compute_block_hashes(prompt, BS))])
            await producer.send_and_wait(catalog.kv_events.name, encode(batch), key=wid.encode())


async def start_router(settings, catalog, name):
    router = build_router_app(settings, catalog, policy="kv", app_id=f"{settings.namespace}-{name}", router_id=name)
    await router.app.start()
    return router


async def test_replicas_agree_and_restart_rebuilds_index(kafka, waiter):
    settings, catalog = kafka
    producer = make_producer(settings)
    await producer.start()
    slots = {"w0": 0, "w1": 1, "w2": 2}
    prompts = {w: [tokens(10 * i + j, 96) for j in range(3)] for i, w in enumerate(slots)}
    await publish_state(producer, catalog, slots, prompts)
    a = await start_router(settings, catalog, "replica-a")
    b = await start_router(settings, catalog, "replica-b")
    try:
        await waiter(lambda: all(r.table.kv_index is not None and len(r.table.workers) == 3
                                 and r.counters["kv_batches"] == 9 for r in (a, b)))
        assert a.table.kv_index == b.table.kv_index

        queue = catalog.queue(WorkerRole.aggregated).name
        consumer = make_consumer(settings, auto_offset_reset="earliest")
        await consumer.start()
        consumer.assign([TopicPartition(queue, p) for p in slots.values()])
        decisions: dict[str, dict[str, str]] = {}
        expected: dict[str, str] = {}
        for i in range(12):
            owner = list(slots)[i % 3]
            prompt = prompts[owner][i % 2] + tokens(1000 + i, 40)  # a cached prefix + a new suffix
            rid = f"r{i}"
            expected[rid] = owner
            req = InferenceRequest(request_id=rid, model=MODEL, token_ids=prompt, created_ms=now_ms(),
                                   reply_to=ReplyTo(topic=catalog.responses.name, partition=0))
            await producer.send_and_wait(catalog.requests.name, encode(req), key=rid.encode())
            # both replicas route it (each in its own group) before the next one
            while len(decisions.get(rid, {})) < 2:
                batches = await consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    for msg in records:
                        routed = decode(InferenceRequest, msg.value)
                        decisions.setdefault(routed.request_id, {})[routed.routing.router_id] = \
                            routed.routing.worker_id
                        assert routed.routing.overlap_blocks == 96 // BS
        await consumer.stop()
        for rid, by_router in decisions.items():
            assert by_router["replica-a"] == by_router["replica-b"] == expected[rid]

        # a router started later rebuilds the same index from the topic
        await b.app.stop()
        more = {"w1": [tokens(77, 64)]}
        batch = KvEventBatch(worker_id="w1", event_id=3, block_size=BS, ts_ms=now_ms(),
                             events=[BlockStored(block_hashes=compute_block_hashes(more["w1"][0], BS))])
        await producer.send_and_wait(catalog.kv_events.name, encode(batch), key=b"w1")
        await waiter(lambda: a.counters["kv_batches"] == 10)
        c = await start_router(settings, catalog, "replica-c")
        try:
            await waiter(lambda: c.counters["kv_batches"] == 10)
            assert c.table.kv_index == a.table.kv_index
            assert c.table.kv_index.find_matches(compute_block_hashes(more["w1"][0], BS)).prefix("w1") == 4
        finally:
            await c.app.stop()
    finally:
        await a.app.stop()
        if b.app.started:
            await b.app.stop()
        await producer.stop()


async def test_event_gap_triggers_dump_request(kafka, waiter):
    settings, catalog = kafka
    producer = make_producer(settings)
    await producer.start()
    await publish_state(producer, catalog, {"w0": 0}, {"w0": [tokens(1, 32)]})
    skipped = KvEventBatch(worker_id="w0", event_id=5, block_size=BS, ts_ms=now_ms(),
                           events=[BlockStored(block_hashes=compute_block_hashes(tokens(2, 32), BS))])
    await producer.send_and_wait(catalog.kv_events.name, encode(skipped), key=b"w0")
    dumps = make_consumer(settings, auto_offset_reset="earliest")
    await dumps.start()
    dumps.assign([TopicPartition(catalog.kv_dump_requests.name, 0)])
    router = await start_router(settings, catalog, "gap")
    try:
        msg = await asyncio.wait_for(dumps.getone(), 20)
        assert decode(__import__("kvflow.schemas", fromlist=["KvDumpRequest"]).KvDumpRequest,
                      msg.value).worker_id == "w0"
        assert router.counters["kv_gaps"] >= 1
    finally:
        await dumps.stop()
        await router.app.stop()
        await producer.stop()


async def read_all(settings, topic: str, partitions: int, quiet_s: float = 1.5) -> list:
    """Every record of ``topic`` so far: reads until ``quiet_s`` pass with nothing new."""
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    out = []
    try:
        idle = 0.0
        while idle < quiet_s:
            batches = await consumer.getmany(timeout_ms=300)
            got = [m for records in batches.values() for m in records]
            out.extend(got)
            idle = 0.0 if got else idle + 0.3
    finally:
        await consumer.stop()
    return out


async def test_binary_kv_events_fold_and_malformed_ones_are_dead_lettered_once(kafka, waiter):
    settings, catalog = kafka
    producer = make_producer(settings)
    await producer.start()
    top = 2**64 - 1
    w0 = compute_block_hashes(tokens(3, 64), BS)
    good = [  # (key, value): binary batches, and one version-1 JSON record still on the topic
        (b"w0", encode(KvEventBatch(worker_id="w0", event_id=0, block_size=BS, ts_ms=now_ms(),
                                    events=[BlockStored(block_hashes=w0 + [top])]))),
        (b"w0", KvEventBatch(worker_id="w0", event_id=1, block_size=BS, ts_ms=now_ms(),
                             events=[BlockRemoved(block_hashes=[top])]).model_copy(update={"schema_version": 1})
         .model_dump_json(exclude_none=True).encode()),
        (b"w1", encode(KvEventBatch(worker_id="w1", event_id=0, block_size=BS, ts_ms=now_ms(),
                                    events=[BlockStored(block_hashes=w0[:2])]))),
    ]
    valid = good[0][1]
    bad = {
        "garbage": bytes(range(255, -1, -1)),
        "wrong_version": valid.replace(b"\xa1v\x02", b"\xa1v\x03"),
        "truncated": valid[:-7],
        # the 16 hash bytes (bin 8, length 0x10) declared 15 long and cut to match: not whole u64s
        "short_hash_array": encode(KvEventBatch(worker_id="w2", event_id=0, block_size=BS, ts_ms=1,
                                                events=[BlockStored(block_hashes=[1, 2])]))
        .replace(b"\xc4\x10", b"\xc4\x0f")[:-1],
        "bad_json": b'{"worker_id": "w3", "events": "none"}',
    }
    assert valid.count(b"\xa1v\x02") == 1 and bad["short_hash_array"].count(b"\xc4\x0f") == 1
    router = await start_router(settings, catalog, "wire")  # its validator reads from the end, as in production
    try:
        await wait_router_ready(settings, catalog, producer)
        for key, value in good[:2]:
            await producer.send_and_wait(catalog.kv_events.name, value, key=key)
        for name, value in bad.items():
            await producer.send_and_wait(catalog.kv_events.name, value, key=name.encode())
        await producer.send_and_wait(catalog.kv_events.name, good[2][1], key=good[2][0])
        await waiter(lambda: router.counters["kv_batches"] == 3 and router.counters["dead_lettered"] == len(bad))
        index = router.table.kv_index
        assert index.held("w0") == set(w0) and index.held("w1") == set(w0[:2])
        assert index.find_matches(w0).prefix("w0") == len(w0)
        assert index.last_event_id("w0") == 1
        letters = [decode(DeadLetter, m.value)
                   for m in await read_all(settings, catalog.dead_letter.name, catalog.dead_letter.partitions)]
        assert len(letters) == len(bad)  # once each, though the projection read them too
        assert {d.key: d.original_value() for d in letters} == bad  # byte for byte, binary ones included
        assert {d.source_topic for d in letters} == {catalog.kv_events.name}
        assert "version 3" in {d.key: d.error for d in letters}["wrong_version"]
    finally:
        await router.app.stop()
        await producer.stop()


async def test_replicas_of_one_router_dead_letter_a_folded_record_once(kafka, waiter):
    """Both replicas fold the workers, kv-events and inflight topics whole, yet a
    malformed record there is dead-lettered by one of them: their validators
    share a consumer group, which splits the partitions between them."""
    settings, catalog = kafka
    folded = (catalog.workers, catalog.kv_events, catalog.inflight)
    wanted = {(s.name, p) for s in folded for p in range(s.partitions)}
    routers = [build_router_app(settings, catalog, policy="kv", app_id=f"{settings.namespace}-shared", router_id=name)
               for name in ("dl-a", "dl-b")]
    producer = make_producer(settings)
    await producer.start()
    for router in routers:
        await router.app.start()

    def held(router) -> set:
        return {(tp.topic, tp.partition) for c in router.validators for tp in c.assignment()}

    try:
        # the group has settled on two members, each holding a share
        await waiter(lambda: all(held(r) for r in routers) and held(routers[0]) | held(routers[1]) == wanted
                     and not held(routers[0]) & held(routers[1]), timeout_s=90)
        bad = {}
        for topic, partition in sorted(wanted):
            meta = await producer.send_and_wait(topic, b"\xff not a record", key=b"bad", partition=partition)
            bad[(topic, partition, meta.offset)] = next(r.router_id for r in routers if (topic, partition) in held(r))
        await waiter(lambda: sum(r.counters["dead_lettered"] for r in routers) >= len(bad), timeout_s=60)

        async def read_past_bad() -> bool:  # every validator has consumed past the bad records
            for router in routers:
                for consumer in router.validators:
                    for tp in consumer.assignment():
                        top = max(o for (t, p, o) in bad if (t, p) == (tp.topic, tp.partition))
                        if await consumer.position(tp) <= top:
                            return False
            return True

        deadline = asyncio.get_running_loop().time() + 60
        while not await read_past_bad():
            assert asyncio.get_running_loop().time() < deadline, "a validator never read past the bad records"
            await asyncio.sleep(0.1)
        assert sum(r.counters["dead_lettered"] for r in routers) == len(bad)  # once each, not once per replica
        letters = [decode(DeadLetter, m.value)
                   for m in await read_all(settings, catalog.dead_letter.name, catalog.dead_letter.partitions)]
        assert {(d.source_topic, d.partition, d.offset): d.consumer for d in letters} == bad
        assert len(letters) == len(bad)
    finally:
        for router in routers:
            await router.app.stop()
        await producer.stop()


async def test_same_long_prompt_returns_to_the_worker_holding_it(kafka, waiter):
    settings, catalog = kafka
    settings = settings.model_copy(update={"routing_policy": "kv"})
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "1", "--block-size", str(BS),
                                                                "--num-kv-blocks", "4096"])
    sup = Supervisor(steady(settings), spec, port=free_port())
    await sup.start()
    try:
        for _ in range(2):
            await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(2, timeout_s=60)
        long_a = "alpha " * 300
        long_b = "bravo " * 300
        await wait_bridge_healthy(sup.url)
        table = sup.router.table

        def kv_folded() -> bool:
            # every request ended, and the index holds the KV events published before their finish records
            index = table.kv_index
            return (index is not None and all(s.held() == 0 for s in table.inflight.workers.values())
                    and not kv_lagging(table, index.last_event_id))

        async with httpx.AsyncClient(base_url=sup.url, timeout=60) as http:

            def body(text, max_tokens):
                return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}

            # A occupies one worker while B arrives, so B lands on the other one
            first_a = asyncio.create_task(http.post("/v1/chat/completions", json=body(long_a, 600)))
            await waiter(lambda: any(s.admitted for s in table.inflight.workers.values()), timeout_s=30)
            # the worker's admission record carries A's output cap, which weighs a prefill placed beside it
            holder, held = next((w, s) for w, s in table.inflight.workers.items() if s.admitted)
            assert [e.max_tokens for e in held.admitted.values()] == [600]
            assert table.workers[holder].stall_exposure == pytest.approx(1 / 599, abs=1e-6)  # summed in millionths
            first_b = (await http.post("/v1/chat/completions", json=body(long_b, 4))).json()
            first_a = (await first_a).json()
            assert first_a["kvflow"]["worker_id"] != first_b["kvflow"]["worker_id"]
            await waiter(kv_folded, timeout_s=30)
            again_b = (await http.post("/v1/chat/completions", json=body(long_b, 4))).json()
            again_a = (await http.post("/v1/chat/completions", json=body(long_a, 4))).json()
        for first, again in ((first_a, again_a), (first_b, again_b)):
            assert again["kvflow"]["worker_id"] == first["kvflow"]["worker_id"]
            assert again["kvflow"]["overlap_blocks"] > 0
            assert again["kvflow"]["policy"] == "kv"
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        published = await read_all(settings, catalog.kv_events.name, catalog.kv_events.partitions, 0.6)
        assert published and all(m.value[0] & 0xF0 == 0x80 for m in published)  # workers publish binary maps
        assert all(decode_kv_frame(m.value).v == 2 for m in published)
    finally:
        await sup.stop()
