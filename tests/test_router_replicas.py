"""Router replicas as their own processes (``kvflow router``) on the real embedded broker.

Two ``kvflow router`` processes share one consumer group in front of an
in-process mocker worker. Replica A holds requests (``queue`` shedding, with a
cold-start hold: no worker serves the model yet), replica B joins the group,
A gets SIGTERM and hands its held requests back to the requests topic, B takes
them, and once a worker starts every request completes exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field

import httpx
from aiokafka import TopicPartition
from deployment import steady

from kvflow.schemas import (
    DecisionOutcome,
    DecisionRecord,
    FinishReason,
    InferenceRequest,
    ReplyTo,
    SamplingParams,
    decode,
    encode,
    now_ms,
)
from kvflow.settings import settings_env
from kvflow.streams.client import KvflowClient
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig
from kvflow.workers.worker import Worker, WorkerConfig

MODEL = "mock-replicas"
HELD = 6
"""Requests replica A holds when it is stopped."""
TOKENS = 8


@dataclass
class RouterProcess:
    """A ``kvflow router`` process and the lines of its stdout, read as they come
    (so a full pipe never blocks it)."""

    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Task | None = None

    async def metrics_url(self, waiter) -> str:
        """The /metrics URL the process prints once it runs."""
        ready = await waiter(lambda: next((ln for ln in self.lines if "; metrics: " in ln), None), timeout_s=120)
        return ready.rsplit("; metrics: ", 1)[1].strip()

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)


async def start_router(settings, router_id: str, group: str) -> RouterProcess:
    """A ``kvflow router`` process with the test's settings, holding cold requests for up to 120 s."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow", "router", "--bootstrap-servers", settings.bootstrap_servers,
        "--namespace", settings.namespace, "--embedded-broker", "--router-id", router_id, "--group", group,
        "--policy", "round_robin", "--shed-mode", "queue", "--shed-cold-start-hold-s", "120", "--metrics-port", "0",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=settings_env(settings, os.environ))
    router = RouterProcess(proc)

    async def read() -> None:
        async for line in proc.stdout:
            router.lines.append(line.decode(errors="replace"))

    router.reader = asyncio.create_task(read())
    return router


class Decisions:
    """The routing-decisions topic, read from its beginning as records come."""

    def __init__(self, settings, catalog) -> None:
        self.records: list[DecisionRecord] = []
        self._settings, self._catalog = settings, catalog
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Decisions":
        consumer = make_consumer(self._settings)
        await consumer.start()
        tps = [TopicPartition(self._catalog.routing_decisions.name, p)
               for p in range(self._catalog.routing_decisions.partitions)]
        consumer.assign(tps)
        for tp in tps:
            await consumer.seek_to_beginning(tp)

        async def read() -> None:
            try:
                while True:
                    for msgs in (await consumer.getmany(timeout_ms=200)).values():
                        self.records += [decode(DecisionRecord, m.value) for m in msgs]
            finally:
                await consumer.stop()

        self._task = asyncio.create_task(read())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def of(self, request_ids, router_id: str, outcome: DecisionOutcome) -> set[str]:
        """Ids of ``request_ids`` that ``router_id`` decided ``outcome`` for."""
        return {r.request_id for r in self.records
                if r.request_id in request_ids and r.router_id == router_id and r.outcome is outcome}


async def test_a_stopped_replica_hands_its_held_requests_to_another(kafka, waiter):
    settings, catalog = kafka
    group = f"{settings.namespace}-router"
    client = KvflowClient(settings, catalog, timeout_s=300)
    await client.start()
    probe_producer = make_producer(settings)
    await probe_producer.start()
    a = await start_router(settings, "replica-a", group)
    b = worker_task = None
    try:
        async with Decisions(settings, catalog) as decisions:
            # A reads the requests topic from its end once it joins: probe until it holds one.
            probes: set[str] = set()
            deadline = asyncio.get_running_loop().time() + 120
            while not decisions.of(probes, "replica-a", DecisionOutcome.queued):
                assert a.proc.returncode is None, "replica A exited"
                assert asyncio.get_running_loop().time() < deadline, "replica A never held a probe"
                rid = f"probe-{len(probes)}"
                probes.add(rid)
                probe = InferenceRequest(request_id=rid, model=MODEL, prompt="x", sampling=SamplingParams(max_tokens=1),
                                         reply_to=ReplyTo(topic=catalog.responses.name, partition=client.slot))
                await probe_producer.send_and_wait(catalog.requests.name, encode(probe), key=rid.encode())
                await asyncio.sleep(1.0)

            requests = [client.new_request(MODEL, token_ids=list(range(i, i + 40)), request_id=f"held-{i}",
                                           sampling=SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                                           deadline_ms=now_ms() + 600_000)
                        for i in range(HELD)]
            ids = {r.request_id for r in requests}
            finals = [asyncio.create_task(client.complete(r)) for r in requests]
            await waiter(lambda: decisions.of(ids, "replica-a", DecisionOutcome.queued) == ids, timeout_s=60)
            async with httpx.AsyncClient(timeout=30) as http:
                scrape = (await http.get(await a.metrics_url(waiter))).text
            held = [line for line in scrape.splitlines() if line.startswith("kvflow_router_queued_requests")]
            assert held and float(held[0].split()[-1]) >= HELD, held

            b = await start_router(settings, "replica-b", group)
            a.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(a.proc.wait(), 120) == 0
            # B takes every partition, reads the handed-back records and holds them (still no worker).
            await waiter(lambda: decisions.of(ids, "replica-b", DecisionOutcome.queued) == ids, timeout_s=120)

            engine = MockerEngine(MockerConfig(speedup_ratio=10.0, block_size=16, num_kv_blocks=1024),
                                  worker_id="w0", model_name=MODEL)
            worker = Worker(steady(settings), WorkerConfig(worker_id="w0", slot=0, model=MODEL), engine, catalog)
            worker_task = asyncio.create_task(worker.run())
            done = await asyncio.wait_for(asyncio.gather(*finals), 120)
            assert all(f.finish_reason is FinishReason.length and f.usage.completion_tokens == TOKENS for f in done), \
                [(f.request_id, f.finish_reason, f.error) for f in done]
            await waiter(lambda: decisions.of(ids, "replica-b", DecisionOutcome.routed) == ids, timeout_s=30)
            routed = [r.request_id for r in decisions.records
                      if r.request_id in ids and r.outcome is DecisionOutcome.routed]
            assert sorted(routed) == sorted(ids)  # each routed once, by B: none ran twice
            worker.stop()
            await worker_task
            worker_task = None
    finally:
        if worker_task is not None:
            worker.stop()
            await worker_task
        for router in (a, b):
            if router is not None:
                await router.kill()
        await probe_producer.stop()
        await client.stop()


async def test_a_deployment_stopping_on_a_cluster_hands_back_its_held_requests(kafka, waiter):
    """`kvflow up` on a Kafka cluster (not its embedded broker) puts the requests its
    router still held back on the requests topic when it stops."""
    from kvflow.supervisor import Supervisor, WorkerSpec

    settings, catalog = kafka
    settings = settings.model_copy(update={"shed_mode": "queue", "shed_cold_start_hold_s": 120.0})
    sup = Supervisor(settings, WorkerSpec(engine="mocker", model=MODEL), bridge=False)
    await sup.start()
    producer = make_producer(settings)
    await producer.start()
    try:
        sent: list[str] = []
        deadline = asyncio.get_running_loop().time() + 120
        while not sup.router.core.held(now_ms())[0]:  # it reads the requests topic from its end once it joins
            assert asyncio.get_running_loop().time() < deadline, "the router never held a request"
            rid = f"cold-{len(sent)}"
            sent.append(rid)
            request = InferenceRequest(request_id=rid, model=MODEL, prompt="x", sampling=SamplingParams(max_tokens=1),
                                       reply_to=ReplyTo(topic=catalog.responses.name, partition=0))
            await producer.send_and_wait(catalog.requests.name, encode(request), key=rid.encode())
            await asyncio.sleep(1.0)
        held = sup.router.core.held(now_ms())[0]
    finally:
        await producer.stop()
        await sup.stop()
    assert sup.router.counters["handed_back"] == held
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(catalog.requests.name, p) for p in range(catalog.requests.partitions)]
        consumer.assign(tps)
        seen: list[str] = []
        deadline = asyncio.get_running_loop().time() + 60
        while sum(seen.count(rid) == 2 for rid in sent) < held:  # each held one: as sent, and handed back
            assert asyncio.get_running_loop().time() < deadline, f"only {seen} on the requests topic"
            for msgs in (await consumer.getmany(timeout_ms=500)).values():
                seen += [m.key.decode() for m in msgs]
    finally:
        await consumer.stop()
    twice = {rid for rid in sent if seen.count(rid) == 2}
    assert len(twice) == held and all(seen.count(rid) in (1, 2) for rid in sent)
