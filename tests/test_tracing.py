"""One request's trace across bridge → router → worker → engine, carried by W3C traceparent headers
on the Kafka records (real embedded broker; the three parts run as tasks of this process, so only
the record headers can link their spans: each part's span runs in its own consumer task)."""

import asyncio

import httpx
import pytest
from aiokafka import TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvflow.router.app import build_router_app
from kvflow.schemas import WorkerRole
from kvflow.streams.kafka import make_consumer
from kvflow.streams.tracing import TRACE_ID_HEADER, extract_context, inject_headers
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig
from kvflow.workers.worker import Worker, WorkerConfig
from deployment import serve_bridge, steady

MODEL = "mock-traced"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """An in-memory exporter on the process's SDK tracer provider (installed if none is)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
async def pipeline(kafka, waiter):
    settings, catalog = kafka
    router = build_router_app(settings, catalog, policy="kv")
    await router.app.start()
    worker = Worker(steady(settings), WorkerConfig(worker_id="w0", slot=0, model=MODEL),
                    MockerEngine(MockerConfig(speedup_ratio=50.0), worker_id="w0", model_name=MODEL), catalog)
    task = asyncio.create_task(worker.run())
    try:
        await waiter(lambda: len(router.table.workers) == 1)
        async with serve_bridge(settings, catalog, slot=3) as (url, _):
            yield settings, catalog, url
    finally:
        worker.stop()
        await task
        await router.app.stop()


async def queue_record_headers(settings, catalog, request_id: str) -> list:
    """Headers of ``request_id``'s record on the worker's queue partition."""
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        tp = TopicPartition(catalog.queue(WorkerRole.aggregated).name, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        for _ in range(50):
            for msg in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                if msg.key == request_id.encode():
                    return list(msg.headers)
        raise AssertionError(f"{request_id} not found on the queue")
    finally:
        await consumer.stop()


async def test_one_request_is_one_trace_across_three_processes(pipeline, spans, waiter):
    settings, catalog, url = pipeline
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "trace me", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    trace_id = answer.headers[TRACE_ID_HEADER]
    request_id = answer.headers["X-Request-Id"]
    assert len(trace_id) == 32 and int(trace_id, 16)

    def ours() -> dict[str, object]:
        return {s.name: s for s in spans.get_finished_spans() if trace.format_trace_id(s.context.trace_id) == trace_id}

    names = {"bridge completions", "router route", "worker serve", "engine generate"}
    found = await waiter(lambda: (lambda got: got if names <= set(got) else None)(ours()), timeout_s=30)
    bridge, router, worker, engine = (found[n] for n in ("bridge completions", "router route", "worker serve",
                                                         "engine generate"))
    # The trace starts in the bridge process (under the HTTP server's own span where FastAPI makes one).
    assert bridge.parent is None or not bridge.parent.is_remote
    assert router.parent.span_id == bridge.context.span_id and router.parent.is_remote
    assert worker.parent.span_id == router.context.span_id and worker.parent.is_remote
    assert engine.parent.span_id == worker.context.span_id and not engine.parent.is_remote
    assert {s.attributes["kvflow.request_id"] for s in (bridge, router, worker)} == {request_id}
    assert router.attributes["kvflow.worker_id"] == "w0" and router.attributes["kvflow.outcome"] == "routed"
    assert engine.attributes["gen_ai.usage.output_tokens"] == 4

    # The link is the queue record's traceparent header, naming the router's span.
    headers = dict(await queue_record_headers(settings, catalog, request_id))
    parent = trace.get_current_span(extract_context(headers)).get_span_context()
    assert (parent.trace_id, parent.span_id) == (router.context.trace_id, router.context.span_id)
    assert headers["traceparent"].decode().startswith(f"00-{trace_id}-")


def test_no_span_no_header():
    assert inject_headers() is None


async def test_streamed_answer_carries_its_trace_id_and_the_span_ends_with_the_stream(pipeline, spans, waiter):
    settings, catalog, url = pipeline
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{url}/v1/completions",
                               json={"model": MODEL, "prompt": "stream me", "max_tokens": 5, "stream": True}) as answer:
            trace_id = answer.headers[TRACE_ID_HEADER]
            body = "".join([chunk async for chunk in answer.aiter_text()])
    assert "[DONE]" in body
    await waiter(lambda: any(s.name == "bridge completions" and trace.format_trace_id(s.context.trace_id) == trace_id
                             for s in spans.get_finished_spans()))


async def test_disaggregated_request_trace_runs_through_prefill_and_decode_workers(kafka, waiter, spans):
    """A long prompt goes router → prefill worker → (forwarded record) → decode worker: one trace."""
    from kvflow.schemas import SamplingParams
    from kvflow.streams.client import KvflowClient
    from kvflow.streams.tracing import tracer

    settings, catalog = kafka
    settings = settings.model_copy(update={"disagg_prefill_threshold_tokens": 64})
    router = build_router_app(settings, catalog, policy="round_robin")
    await router.app.start()
    started = []
    for wid, role in (("p0", WorkerRole.prefill), ("d0", WorkerRole.decode)):
        worker = Worker(steady(settings), WorkerConfig(worker_id=wid, slot=0, model=MODEL, role=role),
                        MockerEngine(MockerConfig(speedup_ratio=50.0, block_size=16), worker_id=wid,
                                     model_name=MODEL), catalog)
        started.append((worker, asyncio.create_task(worker.run())))
    client = KvflowClient(settings, catalog, timeout_s=30)
    try:
        await waiter(lambda: len(router.table.workers) == 2)
        await client.start()
        with tracer().start_as_current_span("client") as root:
            final = await client.complete(client.new_request(MODEL, token_ids=list(range(1, 200)),
                                                             sampling=SamplingParams(max_tokens=4)))
        assert final.error is None and final.worker_id == "d0"
        trace_id = root.get_span_context().trace_id

        def ours():
            got = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
            return got if sum(s.name == "worker serve" for s in got) == 2 else None

        found = await waiter(ours, timeout_s=30)
    finally:
        await client.stop()
        for worker, task in started:
            worker.stop()
            await task
        await router.app.stop()
    serve = {s.attributes["kvflow.worker_id"]: s for s in found if s.name == "worker serve"}
    engines = {s.parent.span_id: s for s in found if s.name == "engine generate"}
    prefill_engine = engines[serve["p0"].context.span_id]
    assert prefill_engine.attributes["kvflow.stage"] == "prefill"
    # The decode worker's span continues the prefill worker's, through the forwarded record's header.
    assert serve["d0"].parent.span_id == prefill_engine.context.span_id and serve["d0"].parent.is_remote
    assert engines[serve["d0"].context.span_id].attributes["kvflow.stage"] == "decode"


async def test_spans_are_exported_over_otlp_only_when_an_endpoint_is_set(tmp_path):
    """A process that calls setup_tracing with KVFLOW_OTLP_ENDPOINT posts its spans there (OTLP/HTTP)."""
    import os
    import sys

    from aiohttp import web

    posts: list[bytes] = []

    async def collect(request: web.Request) -> web.Response:
        posts.append(await request.read())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", collect)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
    script = ("from opentelemetry import trace\n"
              "from kvflow.settings import Settings\n"
              "from kvflow.streams.tracing import setup_tracing, tracer\n"
              "assert setup_tracing(Settings(), 'kvflow-test')\n"
              "with tracer().start_as_current_span('exported-span'):\n"
              "    pass\n"
              "trace.get_tracer_provider().shutdown()\n")
    try:
        for env, expected in (({"KVFLOW_OTLP_ENDPOINT": endpoint}, 1), ({}, 1)):  # posts so far
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVFLOW_OTLP", "OTEL_"))}
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, env={**clean, **env},
                                                        stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()[-2000:]
            assert len(posts) == expected
    finally:
        await runner.cleanup()
    assert b"exported-span" in posts[0] and b"kvflow-test" in posts[0]
