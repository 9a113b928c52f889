"""Disaggregated serving end to end on the real embedded broker.

Mocker tests: in-process prefill and decode :class:`Worker` s; requests are
routed by a small stand-in for the Faust router around the same
:class:`~kvflow.router.core.RouterCore` (its routing step, then
:func:`~kvflow.router.disagg.routed_record`), so the whole flow is real
Kafka: requests → prefill queue → prefill worker → decode queue → decode
worker → responses.

The SmolLM2 acceptance test runs the real deployment (supervisor, Faust
router, bridge, hf worker processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid

import httpx
import pytest
import torch
from aiokafka import TopicPartition
from deployment import read_final, steady

from kvflow.router.core import Arrival, RouterCore
from kvflow.router.disagg import DisaggConfig, Placement, routed_record
from kvflow.schemas import (
    FinalResponse,
    FinishReason,
    InferenceRequest,
    SamplingParams,
    TokenDelta,
    WorkerHeartbeat,
    WorkerRole,
    decode,
    encode,
    now_ms,
)
from kvflow.schemas.transfer import DecodeStage
from kvflow.streams.client import KvflowClient
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig, kv_transfer_time_ms
from kvflow.workers.kv.transfer import KvTransport, TransferConfig
from kvflow.workers.worker import Worker, WorkerConfig

MODEL = "mock-model"
MOCKER = dict(speedup_ratio=50.0, block_size=16, num_kv_blocks=1024)
THRESHOLD = 256


class GlueRouter:
    """Routes the requests topic with a :class:`RouterCore` (what the Faust router's
    ``route_one`` does), folding worker heartbeats into it."""

    def __init__(self, settings, catalog, config: DisaggConfig) -> None:
        self.catalog = catalog
        self.core = RouterCore("round_robin", disagg=config, router_id="glue")
        self.table = self.core.table
        self.placements: dict[str, Placement] = {}
        self.producer = make_producer(settings)
        self.consumer = make_consumer(settings)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.producer.start()
        await self.consumer.start()
        tps = [TopicPartition(self.catalog.requests.name, p) for p in range(self.catalog.requests.partitions)]
        tps += [TopicPartition(self.catalog.workers.name, p) for p in range(self.catalog.workers.partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.consumer.stop()
        await self.producer.stop()

    async def _loop(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100)
            for tp, records in batches.items():
                for msg in records:
                    if tp.topic == self.catalog.workers.name:
                        self.core.on_heartbeat(decode(WorkerHeartbeat, msg.value))
                    else:
                        await self._route(decode(InferenceRequest, msg.value))

    async def _route(self, request: InferenceRequest) -> None:
        decision = self.core.route(Arrival.of(request), now_ms())
        placement, target = decision.placement, decision.target
        record = routed_record(request, placement.decision, decision.decode_worker, placement.plan.remote)
        self.placements[request.request_id] = placement
        await self.producer.send_and_wait(target.queue_topic, encode(record), key=request.request_id.encode(),
                                          partition=target.queue_partition)


async def start_worker(settings, catalog, worker_id: str, role: WorkerRole, slot: int = 0):
    engine = MockerEngine(MockerConfig(**MOCKER), worker_id=worker_id, model_name=MODEL)
    worker = Worker(steady(settings), WorkerConfig(worker_id=worker_id, slot=slot, model=MODEL, role=role), engine,
                    catalog)
    return worker, asyncio.create_task(worker.run())


@pytest.fixture
async def disagg_cluster(kafka, waiter):
    settings, catalog = kafka
    router = GlueRouter(settings, catalog, DisaggConfig(prefill_threshold_tokens=THRESHOLD))
    await router.start()
    workers = {"p0": await start_worker(settings, catalog, "p0", WorkerRole.prefill),
               "d0": await start_worker(settings, catalog, "d0", WorkerRole.decode)}
    await waiter(lambda: len(router.table.workers) == 2)
    client = KvflowClient(settings, catalog, timeout_s=30)
    await client.start()
    yield settings, catalog, router, {k: w for k, (w, _) in workers.items()}, client
    await client.stop()
    for worker, task in workers.values():
        worker.stop()
        await task
    await router.stop()


def prompt_ids(client_worker: Worker, text: str) -> list[int]:
    return client_worker.tokenizer.encode_prompt(text)


async def aggregated_reference(request_id: str, ids: list[int], max_tokens: int) -> list[int]:
    """What one aggregated mocker engine serves for this request (ids depend on request id and seed)."""
    engine = MockerEngine(MockerConfig(**MOCKER), model_name=MODEL)
    await engine.start()
    try:
        request = GenerateRequest(request_id, ids, SamplingParams(max_tokens=max_tokens))
        outs = [o async for o in engine.generate(request)]
    finally:
        await engine.stop()
    return [t for o in outs for t in o.token_ids]


async def test_long_prompt_is_prefilled_remotely_and_decoded_elsewhere(disagg_cluster):
    _, _, router, workers, client = disagg_cluster
    ids = prompt_ids(workers["d0"], "a long shared document. " * 25)  # 600 tokens > 256
    req = client.new_request(MODEL, token_ids=ids, sampling=SamplingParams(max_tokens=12), request_id="long-1")
    events = [e async for e in client.stream(req)]
    deltas, final = events[:-1], events[-1]
    assert isinstance(final, FinalResponse) and final.error is None
    assert router.placements["long-1"].plan.remote
    assert final.worker_id == "d0" and final.routing.worker_id == "d0" and final.routing.prefill_worker_id == "p0"
    assert [d.index for d in deltas] == list(range(len(deltas))) and all(isinstance(d, TokenDelta) for d in deltas)
    assert all(d.worker_id == "d0" for d in deltas)  # one writer per request: the decode worker
    assert final.token_ids == await aggregated_reference("long-1", ids, 12)
    assert final.usage.prompt_tokens == len(ids) and final.usage.completion_tokens == 12
    info = final.kv_transfer
    cfg = MockerConfig(**MOCKER)
    assert info.backend == "simulated" and info.prefill_worker_id == "p0" and not info.recomputed
    assert info.num_bytes == len(ids) * cfg.kv_bytes_per_token
    assert info.transfer_ms == pytest.approx(kv_transfer_time_ms(cfg, len(ids)) / cfg.speedup_ratio, rel=1e-3)
    assert info.num_blocks_pulled == -(-len(ids) // 16) and info.num_blocks_reused == 0
    assert info.prefill_started_ms <= info.prefill_finished_ms <= final.timings.first_token_ms
    assert workers["p0"].served == 1 and workers["d0"].served == 1

    # The same document again: the decode worker now caches its blocks and pulls only the rest.
    again = client.new_request(MODEL, token_ids=ids + prompt_ids(workers["d0"], " and a question?"),
                               sampling=SamplingParams(max_tokens=4), request_id="long-2")
    final2 = await client.complete(again)
    assert final2.routing.prefill_worker_id == "p0"
    assert final2.kv_transfer.num_blocks_reused == len(ids) // 16
    assert final2.kv_transfer.num_bytes < info.num_bytes
    assert final2.usage.cached_tokens == len(ids) // 16 * 16  # the prefill worker's own prefix-cache hit


async def test_short_prompt_stays_on_the_decode_worker(disagg_cluster):
    _, _, router, workers, client = disagg_cluster
    ids = prompt_ids(workers["d0"], "short question?")
    final = await client.complete(client.new_request(MODEL, token_ids=ids, sampling=SamplingParams(max_tokens=5),
                                                     request_id="short-1"))
    assert final.error is None and final.worker_id == "d0"
    assert final.routing.prefill_worker_id is None and final.kv_transfer is None
    assert router.placements["short-1"].plan.reason == "short_prompt"
    assert workers["p0"].served == 0
    assert final.token_ids == await aggregated_reference("short-1", ids, 5)


async def test_concurrent_mix_of_long_and_short_prompts(disagg_cluster):
    _, _, router, workers, client = disagg_cluster
    reqs = []
    for i in range(8):
        text = f"document {i} " * (40 if i % 2 == 0 else 1)
        reqs.append(client.new_request(MODEL, token_ids=prompt_ids(workers["d0"], text),
                                       sampling=SamplingParams(max_tokens=6), request_id=f"mix-{i}"))
    finals = await asyncio.gather(*(client.complete(r) for r in reqs))
    assert all(f.error is None and f.usage.completion_tokens == 6 and f.worker_id == "d0" for f in finals)
    remote = {f.request_id for f in finals if f.kv_transfer is not None}
    assert remote == {r.request_id for r in reqs if router.placements[r.request_id].plan.remote}
    assert remote and remote != {r.request_id for r in reqs}  # both paths taken
    assert workers["p0"].served == len(remote)


async def test_decode_stage_without_kv_is_prefilled_locally(disagg_cluster):
    settings, catalog, _, workers, client = disagg_cluster
    ids = prompt_ids(workers["d0"], "the prefill worker could not expose this one")
    stage = DecodeStage(prefill_worker_id="p0", first_token_id=ids[0], num_prompt_tokens=len(ids), kv=None)
    req = client.new_request(MODEL, token_ids=ids, sampling=SamplingParams(max_tokens=5), request_id="nokv-1",
                             disaggregated_params=stage.to_params())
    stream = client.stream(req)  # submits to the requests topic; the glue router is bypassed below
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(catalog.queue(WorkerRole.decode).name, encode(req), key=b"nokv-1", partition=0)
        events = [e async for e in stream]
    finally:
        await producer.stop()
    final = events[-1]
    assert final.error is None and final.worker_id == "d0"
    assert final.kv_transfer.recomputed and final.kv_transfer.backend == "none"
    assert final.token_ids == await aggregated_reference("nokv-1", ids, 5)


async def test_cancel_right_after_the_prefill_is_answered_by_the_prefill_worker(disagg_cluster, waiter):
    """The cancel lands after the engine finished the prefill (its engine abort
    comes too late): the prefill worker answers ``abort`` and forwards nothing."""
    settings, catalog, router, workers, client = disagg_cluster
    p0, d0 = workers["p0"], workers["d0"]
    engine_prefill = p0.engine.prefill

    async def prefill_then_cancel(gen):
        result = await engine_prefill(gen)
        await client.cancel(gen.request_id)
        await waiter(lambda: p0.is_cancelled(gen.request_id))
        return result

    p0.engine.prefill = prefill_then_cancel
    ids = prompt_ids(d0, "a document cancelled just after its prefill. " * 20)
    req = client.new_request(MODEL, token_ids=ids, sampling=SamplingParams(max_tokens=8), request_id="late-cancel")
    final = await client.complete(req)
    assert router.placements["late-cancel"].plan.remote
    assert final.finish_reason is FinishReason.abort and final.worker_id == "p0"
    assert final.usage.completion_tokens == 0 and final.error is None
    assert p0.aborted == 1
    # nothing reached the decode queue: a later request is the decode worker's first
    p0.engine.prefill = engine_prefill
    after = await client.complete(client.new_request(MODEL, token_ids=ids, sampling=SamplingParams(max_tokens=2)))
    assert after.finish_reason is FinishReason.length and after.worker_id == "d0"
    assert d0.served == 1 and d0.aborted == 0


async def test_decode_worker_releases_the_kv_of_a_request_cancelled_before_it_arrived(disagg_cluster, waiter):
    """A forwarded request whose cancel the decode worker already holds is
    answered ``abort`` on arrival, and its exposed KV is freed at the source
    then, not when the source's TTL runs out."""
    settings, catalog, _, workers, client = disagg_cluster
    d0 = workers["d0"]
    source = KvTransport("p-src", TransferConfig(backend="tcp", ttl_s=600))
    await source.start()
    try:
        blocks = torch.arange(4 * 64, dtype=torch.uint8)
        desc = await source.expose("gone-1", blocks, block_bytes=64, num_blocks=4, num_tokens=60, dtype="uint8",
                                   block_shape=(64,))
        assert source.num_exposed == 1
        ids = prompt_ids(d0, "cancelled while its KV waited")
        stage = DecodeStage(prefill_worker_id="p-src", first_token_id=ids[0], num_prompt_tokens=len(ids), kv=desc)
        req = client.new_request(MODEL, token_ids=ids, sampling=SamplingParams(max_tokens=5), request_id="gone-1",
                                 disaggregated_params=stage.to_params())
        await client.cancel("gone-1")
        await waiter(lambda: "gone-1" in d0.early_cancels)
        producer = make_producer(settings)
        await producer.start()
        try:
            await producer.send_and_wait(catalog.queue(WorkerRole.decode).name, encode(req), key=b"gone-1",
                                         partition=0)
        finally:
            await producer.stop()
        final = await read_final(settings, catalog, client.slot, "gone-1")
        assert final.finish_reason is FinishReason.abort and final.worker_id == "d0"
        assert final.usage.completion_tokens == 0
        await waiter(lambda: source.num_exposed == 0, timeout_s=5)
    finally:
        await source.close()


def test_bridge_metrics_count_remote_and_local_prefills():
    from prometheus_client import generate_latest

    from kvflow.schemas import FinishReason, RoutingDecision
    from kvflow.schemas.transfer import KvTransferInfo
    from kvflow.streams.bridge.metrics import BridgeMetrics, RequestObserver
    from kvflow.streams.bridge.worker_registry import WorkerRegistry

    registry = WorkerRegistry(clock=lambda: 1_500)
    for worker_id, role, waiting in [("p0", WorkerRole.prefill, 3), ("p1", WorkerRole.prefill, 1),
                                     ("d0", WorkerRole.decode, 7)]:
        registry.apply(WorkerHeartbeat(worker_id=worker_id, role=role, model=MODEL, engine="mocker", block_size=16,
                                       kv_total_blocks=10, queue_topic="q", queue_partition=0,
                                       waiting_requests=waiting, ts_ms=1_000))
    metrics = BridgeMetrics()
    metrics.track_workers(registry)
    metrics.track_workers(registry)  # idempotent: a second registration would raise in prometheus_client

    def finish(final: FinalResponse, status: int = 200) -> None:
        observer = RequestObserver(metrics, "chat")
        observer.submitted(final.request_id, MODEL, 100)
        observer.on_event(final)
        observer.finish(status)

    remote = KvTransferInfo(backend="nixl", prefill_worker_id="p0", num_bytes=3 * 2**20, transfer_ms=2.5)
    routing = RoutingDecision(worker_id="d0", policy="kv", prefill_worker_id="p0")
    finish(FinalResponse(request_id="a", finish_reason=FinishReason.stop, routing=routing, kv_transfer=remote))
    finish(FinalResponse(request_id="b", finish_reason=FinishReason.stop, routing=routing,
                         kv_transfer=KvTransferInfo(prefill_worker_id="p0", recomputed=True)))
    finish(FinalResponse(request_id="c", finish_reason=FinishReason.length))
    finish(FinalResponse(request_id="d", finish_reason=FinishReason.error), status=500)  # failures count nowhere
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "kvflow_prefill_remote_total", model=MODEL) == 1
    assert metric(text, "kvflow_prefill_local_total", model=MODEL) == 2
    assert metric(text, "kvflow_kv_transfer_recomputed_total", model=MODEL) == 1
    assert metric(text, "kvflow_kv_transfer_bytes_sum", backend="nixl") == 3 * 2**20
    assert metric(text, "kvflow_kv_transfer_seconds_sum", backend="nixl") == pytest.approx(0.0025)
    assert metric(text, "kvflow_prefill_queue_depth", model=MODEL) == 4
    assert metric(text, "kvflow_prefill_workers", model=MODEL) == 2


# --------------------------------------------------------------------------- SmolLM2 acceptance

SMOL = "SmolLM2-135M-Instruct"
# ~1300 prompt tokens: above the default 1000-token threshold of the router.
LONG_DOC = " ".join(f"Entry {i}: the {c} harbour crane lifted {i * 11} crates onto the {s} ship."
                    for i, (c, s) in enumerate([("red", "grey"), ("tall", "small"), ("old", "new"),
                                                ("rusty", "fast")] * 14))
PROMPTS = [LONG_DOC + " Which crane lifted 55 crates?", "What is the capital of France?"]


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one Prometheus sample (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", line)
        if m and (m.group(2) or "") == want:
            return float(m.group(3))
    return 0.0


async def ask(http: httpx.AsyncClient, content: str) -> dict:
    reply = await http.post("/v1/chat/completions", json={
        "model": SMOL, "temperature": 0, "max_tokens": 24, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
async def test_smollm2_disaggregated_matches_aggregated_through_the_bridge(broker):
    from kvflow.settings import Settings
    from kvflow.streams.broker import free_port
    from kvflow.streams.catalog import Catalog
    from kvflow.streams.kafka import create_topics
    from kvflow.supervisor import Supervisor, WorkerSpec

    settings = Settings(bootstrap_servers=broker.bootstrap_servers, embedded_broker=True,
                        namespace=f"dg{uuid.uuid4().hex[:8]}", session_timeout_ms=2000)
    await create_topics(settings, Catalog(settings.namespace))
    sup = Supervisor(steady(settings), WorkerSpec(engine="hf", model=SMOL), port=free_port())
    await sup.start()
    try:
        async with httpx.AsyncClient(base_url=sup.url, timeout=300) as http:
            # Aggregated reference: one aggregated worker.
            await sup.scale(WorkerRole.aggregated, 1)
            await sup.wait_workers_ready(1, timeout_s=240)
            aggregated = [await ask(http, p) for p in PROMPTS]

            # Disaggregated: one prefill worker, one decode worker, starting while the
            # aggregated one drains; no request is sent before it has left the table.
            await sup.scale(WorkerRole.prefill, 1)
            await sup.scale(WorkerRole.decode, 1)
            await sup.scale(WorkerRole.aggregated, 0)

            def aggregated_left() -> bool:
                return all(w.role != WorkerRole.aggregated for w in sup.router.table.workers.values())

            deadline = asyncio.get_running_loop().time() + 60
            while not aggregated_left() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            assert aggregated_left()
            before = (await http.get("/metrics")).text
            await sup.wait_workers_ready(2, timeout_s=240)
            disaggregated = [await ask(http, p) for p in PROMPTS]
            after = (await http.get("/metrics")).text
            await ask(http, PROMPTS[0])  # a third time, for the chunk cache (below)
            resent = (await http.get("/metrics")).text
    finally:
        await sup.stop()

    for agg, dis in zip(aggregated, disaggregated):
        assert dis["choices"][0]["message"]["content"] == agg["choices"][0]["message"]["content"]
        assert dis["usage"]["completion_tokens"] == agg["usage"]["completion_tokens"]
        assert dis["usage"]["prompt_tokens"] == agg["usage"]["prompt_tokens"]
    assert aggregated[0]["usage"]["prompt_tokens"] > 1000
    long_info, short_info = disaggregated[0]["kvflow"], disaggregated[1]["kvflow"]
    assert long_info["worker_id"].startswith("dec") and long_info["prefill_worker_id"].startswith("pre")
    assert short_info["worker_id"].startswith("dec") and "prefill_worker_id" not in short_info
    # The bridge's metrics: the long prompt's prefill ran remotely, the short one locally.
    assert metric(after, "kvflow_prefill_remote_total", model=SMOL) - metric(before, "kvflow_prefill_remote_total",
                                                                               model=SMOL) == 1
    assert metric(after, "kvflow_prefill_local_total", model=SMOL) - metric(before, "kvflow_prefill_local_total",
                                                                             model=SMOL) == 1
    # The long prompt was sent three times, one after another. Each process that encodes prompts
    # keeps its own chunk cache: the bridge (a short prompt while every tokenize child is busy, e.g.
    # loading at start) or the first free child, the first one when all are idle. Two of the three
    # sends went through one of those two, and the later took its chunks from that cache.
    cached = [float(v) for v in re.findall(r'^kvflow_bridge_tokenize_chars_total\{.*source="cache".*\} (\S+)$',
                                           resent, re.M)]
    assert cached and sum(cached) > 0.8 * len(LONG_DOC)
    transfers = [ln for ln in after.splitlines() if ln.startswith("kvflow_kv_transfer_bytes_count")]
    assert transfers and sum(float(ln.split()[-1]) for ln in transfers) == 1
    assert metric(after, "kvflow_prefill_workers", model=SMOL) == 1
