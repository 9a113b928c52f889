"""Every consumed topic dead-letters malformed records once, and its consumers go on.

A whole deployment runs in this process on the real embedded broker: a
router (``kv`` policy, so it also folds the kv-events topic), one mocker
worker, a Kafka-native client, the HTTP bridge, the planner's metrics sink
(on a real chDB) and a scaling connector. Into every partition one of them
consumes, the test writes a non-UTF-8 garbage record and a JSON record that
fails its topic's schema, then checks that the dead-letter topic gets exactly
one letter for each (from the one consumer responsible, with the reason and
the original bytes), and that every consumer still does its job afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition
from deployment import in_process_cluster, serve_bridge

from kvflow.planner.connectors import ConnectorService
from kvflow.planner.service import open_shared_clickhouse
from kvflow.planner.sink_service import SinkService
from kvflow.schemas import (
    DeadLetter,
    FinalResponse,
    FinishReason,
    KvDumpRequest,
    RequestMetrics,
    SamplingParams,
    ScalingCommand,
    TokenDelta,
    WorkerRole,
    decode,
    encode,
    now_ms,
)
from kvflow.streams.admin import send_admin_command
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.workers.engines.mocker_core import MockerConfig

MODEL = "mock-dlq"
LONG = 5000
"""max_tokens of the request that is cancelled (~30 s of mocker decode)."""
GARBAGE = b"\xff\xfe\x00 not a record \x9c\x80\xc3"
"""Not JSON, and not even UTF-8: the dead letter must keep these bytes exactly."""
SCHEMA_INVALID = b'{"schema_version": 1, "request_id": ["r"], "worker_id": 5, "ts_ms": "soon"}'
"""Valid JSON that fits no topic's schema."""
KEY = b"bad-\xff-key"


class RecordingConnector:
    """A scaling connector that only records the targets it is given."""

    name = "recording"

    def __init__(self) -> None:
        self.targets: list[int] = []

    async def apply(self, command: ScalingCommand) -> int:
        """Record ``command``'s target and report it reached."""
        self.targets.append(command.target_replicas)
        return command.target_replicas


@dataclass
class Deployment:
    """The parts of the running deployment the test looks at."""

    settings: Any
    catalog: Any
    router: Any
    worker: Any
    client: Any
    bridge_url: str
    bridge_slot: int
    clickhouse: Any
    sink: SinkService
    connector: ConnectorService


@pytest.fixture
async def deployment(kafka, waiter, tmp_path):
    """Router, worker ``w0``, client, bridge, metrics sink and connector, all started."""
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=1.0, block_size=16, num_kv_blocks=1024)
    async with contextlib.AsyncExitStack() as stack:
        router, (worker,), client = await stack.enter_async_context(in_process_cluster(
            settings, catalog, waiter, model=MODEL, mocker=mocker, workers=1, client_timeout_s=30, policy="kv"))
        bridge_slot = (client.slot + 1) % catalog.responses.partitions  # one reader per responses slot
        url, _ = await stack.enter_async_context(serve_bridge(settings, catalog, bridge_slot))
        clickhouse = await open_shared_clickhouse(settings, tmp_path / "chdb")
        stack.callback(clickhouse.close)
        sink = SinkService(settings, catalog, clickhouse, flush_interval_s=0.2)
        await sink.start()
        stack.push_async_callback(sink.stop)
        connector = ConnectorService(settings, catalog, RecordingConnector())
        await connector.start()
        stack.push_async_callback(connector.stop)
        yield Deployment(settings, catalog, router, worker, client, url, bridge_slot, clickhouse, sink, connector)


class DeadLetterReader:
    """Reads the dead-letter topic from its beginning, keeping every letter."""

    def __init__(self, settings, catalog) -> None:
        self.tp = TopicPartition(catalog.dead_letter.name, 0)
        self.consumer = make_consumer(settings, fetch_max_wait_ms=100)
        self.letters: list[DeadLetter] = []
        self.next_offset = 0

    async def __aenter__(self) -> "DeadLetterReader":
        await self.consumer.start()
        self.consumer.assign([self.tp])
        await self.consumer.seek_to_beginning(self.tp)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> int:
        """One fetch; returns how many letters it added."""
        records = (await self.consumer.getmany(self.tp, timeout_ms=timeout_ms)).get(self.tp, [])
        for msg in records:
            self.letters.append(decode(DeadLetter, msg.value))
            self.next_offset = msg.offset + 1
        return len(records)

    async def wait_for(self, predicate, timeout_s: float = 60.0) -> None:
        """Read until ``predicate(letters)`` holds.

        Raises:
            AssertionError: it did not within ``timeout_s``.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self.letters):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"dead letters never matched; have {self.summary()}")
            await self.poll()

    async def settle(self, quiet_polls: int = 4, timeout_s: float = 60.0) -> None:
        """Read until the topic's high watermark stops growing: ``quiet_polls``
        fetches in a row bring nothing and the watermark is where reading ended.

        Raises:
            AssertionError: letters kept coming for ``timeout_s``.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        quiet = 0
        while quiet < quiet_polls:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"dead letters kept coming; have {self.summary()}")
            got = await self.poll(timeout_ms=500)
            highwater = self.consumer.highwater(self.tp)
            quiet = 0 if got or highwater is None or highwater > self.next_offset else quiet + 1

    def summary(self) -> Counter:
        """Letters per (source topic, partition, consumer)."""
        return Counter((d.source_topic, d.partition, d.consumer) for d in self.letters)


def router_assigned(router, catalog) -> bool:
    """The router's consumer groups (its agents' and its validators') hold every partition of the topics they read."""
    specs = (catalog.requests, catalog.workers, catalog.kv_events, catalog.cancels, catalog.kv_dump_requests,
             catalog.inflight, catalog.control)
    wanted = {(s.name, p) for s in specs for p in range(s.partitions)}
    return wanted <= router.assigned()


async def complete_via_client(client, prompt: str) -> FinalResponse:
    final = await client.complete(client.new_request(MODEL, prompt=prompt, sampling=SamplingParams(max_tokens=4)))
    assert final.finish_reason is FinishReason.length, final
    return final


async def test_every_consumed_topic_dead_letters_bad_records_once_and_goes_on(deployment, waiter):
    d = deployment
    settings, catalog = d.settings, d.catalog
    await waiter(lambda: router_assigned(d.router, catalog), timeout_s=60)
    await complete_via_client(d.client, "warm-up")  # the router's positions are resolved: nothing is skipped

    # (topic, partition) -> the one consumer that must dead-letter what lands there
    targets = {
        (catalog.requests.name, 0): d.router.router_id,
        (catalog.queue(WorkerRole.aggregated).name, d.worker.config.slot): d.worker.config.worker_id,
        (catalog.responses.name, d.client.slot): f"client:{d.client.slot}",
        (catalog.responses.name, d.bridge_slot): f"bridge:{d.bridge_slot}",
        (catalog.workers.name, 0): d.router.router_id,
        (catalog.kv_events.name, 0): d.router.router_id,
        (catalog.inflight.name, 0): d.router.router_id,
        (catalog.kv_dump_requests.name, 0): d.router.router_id,
        (catalog.metrics.name, 0): "planner-sink",
        (catalog.cancels.name, 0): d.router.router_id,
        (catalog.control.name, 0): d.router.router_id,
        (catalog.scaling.name, 0): "connector-recording",
    }
    assert {t for t, _ in targets} == {s.name for s in catalog.all() if s.name != catalog.dead_letter.name} - {
        catalog.queue(WorkerRole.prefill).name, catalog.queue(WorkerRole.decode).name,  # no such workers run
        catalog.queue(WorkerRole.embedding).name,  # tests/test_embeddings.py covers its dead letters
        catalog.queue(WorkerRole.encode).name,  # tests/test_multimodal_live.py covers its dead letters
        catalog.queue(WorkerRole.conditioning).name,  # tests/test_images_live.py covers both image stages
        catalog.queue(WorkerRole.diffusion).name,
        catalog.routing_decisions.name,  # read only by `kvflow explain`, which skips malformed records
        catalog.responses_log.name,  # read only by previous_response_id lookups, which skip them too
        catalog.expert_placement.name}  # published by `kvflow eplb`; no process consumes it yet

    produced: dict[tuple[str, int, int], bytes] = {}
    producer = make_producer(settings)
    await producer.start()
    try:
        for topic, partition in targets:
            for value in (GARBAGE, SCHEMA_INVALID):
                meta = await producer.send_and_wait(topic, value, key=KEY, partition=partition)
                produced[(topic, partition, meta.offset)] = value
    finally:
        await producer.stop()

    async with DeadLetterReader(settings, catalog) as reader:
        await reader.wait_for(lambda letters: {(x.source_topic, x.partition, x.offset) for x in letters}
                              >= set(produced))
        for letter in reader.letters:
            where = (letter.source_topic, letter.partition, letter.offset)
            assert where in produced, letter
            assert letter.consumer == targets[where[:2]], letter
            assert letter.original_value() == produced[where] and letter.original_key() == KEY
            assert letter.error
            if produced[where] == SCHEMA_INVALID:
                assert letter.value == SCHEMA_INVALID.decode() and letter.value_b64 is None
            else:
                assert letter.value_b64 is not None and "\ufffd" in letter.value

        # Every consumer goes on. Requests, the worker's queue, both responses slots, the workers topic:
        await complete_via_client(d.client, "after the garbage")
        async with httpx.AsyncClient(base_url=d.bridge_url, timeout=30) as http:
            reply = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "after the garbage"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length", reply.text

        # cancels (the worker's control consumer):
        req = d.client.new_request(MODEL, prompt="cancel me", sampling=SamplingParams(max_tokens=LONG))
        cancelled, final = None, None
        async with contextlib.aclosing(d.client.stream(req)) as stream:
            async for event in stream:
                if isinstance(event, TokenDelta) and cancelled is None:
                    cancelled = True
                    await d.client.cancel(req.request_id)
                elif isinstance(event, FinalResponse):
                    final = event
        assert final is not None and final.finish_reason is FinishReason.abort and final.usage.completion_tokens < LONG // 10

        # control (the worker's control consumer): an admin command is still answered.
        answer = await send_admin_command(settings, d.worker.config.worker_id, "clear_kv", timeout_s=30,
                                          catalog=catalog)
        assert answer.ok, answer.detail

        # kv-dump-requests (worker) and kv-events (router projection):
        dumps: list[int] = []
        publish_dump = d.worker._publish_dump

        async def counted_dump() -> None:
            dumps.append(1)
            await publish_dump()

        d.worker._publish_dump = counted_dump
        batches = d.router.counters["kv_batches"]
        producer = make_producer(settings)
        await producer.start()
        try:
            ask = KvDumpRequest(worker_id=d.worker.config.worker_id, requested_by="test", ts_ms=now_ms())
            await producer.send_and_wait(catalog.kv_dump_requests.name, encode(ask), key=b"w0", partition=0)
            # metrics (the sink), on the partition that held the bad records:
            probe = RequestMetrics(ts_ms=now_ms(), request_id="dlq-probe", model=MODEL, worker_id="w0", isl=1,
                                   osl=1, ttft_ms=1.0, itl_ms=0.0, e2e_ms=1.0)
            await producer.send_and_wait(catalog.metrics.name, encode(probe), key=b"w0", partition=0)
            # scaling (the connector):
            await producer.send_and_wait(catalog.scaling.name, encode(ScalingCommand(
                decision_id="after-garbage", pool=WorkerRole.aggregated, target_replicas=2, ts_ms=now_ms())),
                key=b"aggregated", partition=0)
        finally:
            await producer.stop()
        await waiter(lambda: dumps and d.router.counters["kv_batches"] > batches, timeout_s=30)
        await waiter(lambda: [a.decision_id for a in d.connector.applied] == ["after-garbage"], timeout_s=30)

        async def probe_rows() -> int:
            return await d.clickhouse.run(lambda: int(d.clickhouse.client.query(
                "SELECT count() FROM request_metrics WHERE request_id = 'dlq-probe'").result_rows[0][0]))

        deadline = asyncio.get_running_loop().time() + 30
        while await probe_rows() == 0:  # the sink inserts every 0.2 s
            assert asyncio.get_running_loop().time() < deadline, "the sink never wrote the probe row"
            await asyncio.sleep(0.1)

        # Exactly one letter per bad record: nothing more arrives once the topic is quiet.
        await reader.settle()
        per_target = Counter((x.source_topic, x.partition) for x in reader.letters)
        assert per_target == {target: 2 for target in targets}, reader.summary()
        assert len({(x.source_topic, x.partition, x.offset) for x in reader.letters}) == len(reader.letters)

    assert d.router.counters["dead_lettered"] == 14
    assert d.worker.dlq.count == 2 and d.worker.malformed_cancels == 2
    assert d.sink.dlq.count == 2 and d.connector.dlq.count == 2
