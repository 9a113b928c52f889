"""A whole kvflow deployment (as `kvflow up` runs it) for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from aiokafka import TopicPartition

from kvflow.schemas import FinalResponse, ResponseEvent, WorkerRole, decode
from kvflow.settings import Settings
from kvflow.streams.broker import free_port
from kvflow.streams.kafka import make_consumer
from kvflow.supervisor import Supervisor, WorkerSpec


async def wait_bridge_healthy(url: str, timeout_s: float = 10.0) -> None:
    """Wait until the bridge's own projection of the workers topic sees a live worker.

    Raises:
        TimeoutError: ``/health`` did not answer 200 in time.
    """
    async with httpx.AsyncClient(base_url=url) as http:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (await http.get("/health")).status_code != 200:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{url}/health never answered 200")
            await asyncio.sleep(0.05)


async def wait_models(url: str, models: list[str], timeout_s: float = 60.0) -> None:
    """Wait until the bridge lists every model of ``models`` on ``/v1/models``
    (its worker projection can see a new worker a poll later than the router).

    Raises:
        TimeoutError: not all listed in time.
    """
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            listed = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
            if set(models) <= listed:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{url} lists {sorted(listed)}, not all of {models}")
            await asyncio.sleep(0.1)


STEADY_WORKER_TTL_MS = 60_000
"""Heartbeat TTL of workers in a test that kills none before teardown: a heartbeat
late by seconds on a loaded machine must not read as a lost worker (seen: requests
answered ``no_workers``, a worker missing from the router's table mid-test)."""


KILLED_WORKER_TTL_MS = 5_000
"""Heartbeat TTL of workers in a test that SIGKILLs some: a loss is seen within
seconds, as at the default ``worker_ttl_ms``."""


def steady(settings: Settings) -> Settings:
    """``settings`` with the workers' heartbeat TTL raised to :data:`STEADY_WORKER_TTL_MS`."""
    return settings.model_copy(update={"worker_ttl_ms": max(settings.worker_ttl_ms, STEADY_WORKER_TTL_MS)})


@contextlib.asynccontextmanager
async def running_deployment(settings: Settings, spec: WorkerSpec, workers: int, *, bridge: bool = True,
                             ready_timeout_s: float = 60.0,
                             worker_ttl_ms: int | None = STEADY_WORKER_TTL_MS) -> AsyncIterator[Supervisor]:
    """Router, ``workers`` aggregated worker processes and (optionally) the bridge on ``settings``' broker.

    The worker processes beat at ``settings``' heartbeat interval and announce
    ``worker_ttl_ms`` (``None``: ``settings``' own); a test that kills workers
    passes the TTL it means to detect the loss at.
    """
    if worker_ttl_ms is not None:
        settings = settings.model_copy(update={"worker_ttl_ms": worker_ttl_ms})
    sup = Supervisor(settings, spec, port=free_port(), bridge=bridge)
    await sup.start()
    try:
        for _ in range(workers):
            await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(workers, timeout_s=ready_timeout_s)
        if bridge:
            await wait_bridge_healthy(sup.url)
        yield sup
    finally:
        await sup.stop()


@contextlib.asynccontextmanager
async def serve_app(app, *, lifespan: str = "on") -> AsyncIterator[str]:
    """Serve ``app`` with the bridge's uvicorn server (:class:`~kvflow.streams.bridge.server.BridgeServer`)
    in this process on a free loopback port until the block exits; yields its base URL.

    Raises:
        AssertionError: the server exited during start-up.
    """
    import uvicorn

    from kvflow.streams.bridge.server import BridgeServer

    port = free_port()
    server = BridgeServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "server exited during start-up"
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def serve_bridge(settings: Settings, catalog, slot: int) -> AsyncIterator[tuple]:
    """The HTTP bridge on responses partition ``slot``, served by uvicorn in this process on a free
    port until it reports a live worker; yields ``(url, bridge state)``.

    Raises:
        AssertionError: the server exited during start-up.
        TimeoutError: the bridge never saw a live worker.
    """
    from kvflow.streams.bridge import build_app

    app = build_app(settings, catalog, slot=slot)
    async with serve_app(app) as url:
        await wait_bridge_healthy(url)
        yield url, app.state.bridge


@contextlib.asynccontextmanager
async def in_process_cluster(settings: Settings, catalog, waiter, *, model: str, mocker, workers: int = 2,
                             client_timeout_s: float = 30.0, policy: str = "round_robin") -> AsyncIterator[tuple]:
    """A router (round-robin unless ``policy`` says otherwise), ``workers`` mocker workers (slots
    0..n-1, ids ``w0``...) and a started client, all in this process on the given broker; yields
    ``(router, [Worker], client)``.

    In-process parts let a test read a worker's counters and engine state
    while every record still travels through the broker.
    """
    from kvflow.router.app import build_router_app
    from kvflow.streams.client import KvflowClient
    from kvflow.workers.engines.mocker import MockerEngine
    from kvflow.workers.worker import Worker, WorkerConfig

    router = build_router_app(settings, catalog, policy=policy)
    await router.app.start()
    worker_settings = steady(settings)  # no worker of an in-process cluster dies before teardown
    started: list[tuple[Worker, asyncio.Task]] = []
    client = KvflowClient(settings, catalog, timeout_s=client_timeout_s)
    try:
        for i in range(workers):
            engine = MockerEngine(mocker, worker_id=f"w{i}", model_name=model)
            worker = Worker(worker_settings, WorkerConfig(worker_id=f"w{i}", slot=i, model=model), engine, catalog)
            started.append((worker, asyncio.create_task(worker.run())))
        await waiter(lambda: len(router.table.workers) == workers, timeout_s=120)  # a loaded machine starts slowly
        await client.start()
        yield router, [w for w, _ in started], client
    finally:
        await client.stop()
        for worker, task in started:
            worker.stop()
            await task
        await router.app.stop()


async def read_final(settings, catalog, slot: int, request_id: str, timeout_s: float = 10.0) -> FinalResponse:
    """The final response of ``request_id`` in responses partition ``slot`` (read from its beginning)."""
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        tp = TopicPartition(catalog.responses.name, slot)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            for msg in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                event = decode(ResponseEvent, msg.value)
                if isinstance(event, FinalResponse) and event.request_id == request_id:
                    return event
        raise AssertionError(f"no final response for {request_id} within {timeout_s} s")
    finally:
        await consumer.stop()


async def wait_router_ready(settings, catalog, producer, slot: int = 15, attempts: int = 30) -> None:
    """Return once a started router has answered a probe request (an unserved model gets a 503).

    The router's agents read from the latest offset: records sent before its consumer is
    positioned are never seen, so a test that needs every record it sends read waits here first.
    A probe sent too early is itself never answered, so another is sent every 2 s.
    """
    from kvflow.schemas import InferenceRequest, ReplyTo, encode

    for attempt in range(attempts):
        rid = f"probe-{attempt}"
        probe = InferenceRequest(request_id=rid, model="probe", prompt="x",
                                 reply_to=ReplyTo(topic=catalog.responses.name, partition=slot))
        await producer.send_and_wait(catalog.requests.name, encode(probe), key=rid.encode())
        with contextlib.suppress(AssertionError):
            await read_final(settings, catalog, slot, rid, timeout_s=2.0)
            return
    raise AssertionError("the router answered no probe")


async def first_record(settings: Settings, topic: str, partitions: int, pick: Callable[[bytes], Any],
                       timeout_s: float, poll_ms: int = 200) -> Any:
    """The first value other than None that ``pick`` returns for a record value of
    ``topic`` (its ``partitions`` read from the beginning); None if none within ``timeout_s``."""
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        for tp in tps:
            await consumer.seek_to_beginning(tp)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            for msgs in (await consumer.getmany(*tps, timeout_ms=poll_ms)).values():
                for msg in msgs:
                    found = pick(msg.value)
                    if found is not None:
                        return found
        return None
    finally:
        await consumer.stop()
