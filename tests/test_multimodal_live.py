"""The same image twice, live: bridge → requests → router → encode worker →
mocker worker on the real embedded broker. The second request finds the
image's embeddings in the encode worker's cache (Prometheus hit counter) and
is routed to the worker holding the image's KV blocks, although the routing
tie-break would pick the other one; another image with the very same token
ids overlaps nothing. Media that do not decode are answered 400 by the
encode worker, and a malformed record on its queue is dead-lettered."""

from __future__ import annotations

import asyncio
import io

import httpx
from aiokafka import TopicPartition
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from deployment import STEADY_WORKER_TTL_MS, in_process_cluster, serve_app, serve_bridge, steady
from kvflow.schemas import DeadLetter, FinalResponse, SamplingParams, WorkerRole, decode
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.workers.encode_worker import EncodeWorker, EncodeWorkerConfig
from kvflow.workers.engines.mocker_core import MockerConfig
from kvflow.workers.main import DEFAULT_MEDIA_HIDDEN_SIZE
from kvflow.workers.media_encoder import build_media_encoder
from kvflow.workers.prometheus import encode_registry

MODEL = "mock-vlm"
BRIDGE_SLOT = 29
TEXT = "Describe this picture in a few words, then say what colour it mostly is and why that matters."


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, "PNG")
    return buf.getvalue()


def _media_app() -> Starlette:
    def fixed(body: bytes):
        async def handler(_):
            return Response(body, media_type="image/png")
        return handler

    return Starlette(routes=[Route("/a.png", fixed(_png((250, 0, 0)))), Route("/b.png", fixed(_png((0, 0, 250)))),
                             Route("/junk.png", fixed(b"\x89PNG but not really"))])


def _chat(image_url: str) -> dict:
    return {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                      {"type": "text", "text": TEXT}]}]}


async def _dead_letter_of(settings, catalog, topic: str, timeout_s: float = 60.0) -> DeadLetter:
    consumer = make_consumer(settings, fetch_max_wait_ms=100)
    await consumer.start()
    try:
        tp = TopicPartition(catalog.dead_letter.name, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            for msg in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                letter = decode(DeadLetter, msg.value)
                if letter.source_topic == topic:
                    return letter
        raise AssertionError(f"no dead letter from {topic} within {timeout_s} s")
    finally:
        await consumer.stop()


async def test_the_same_image_twice_hits_the_embedding_cache_and_the_worker_holding_its_blocks(kafka, waiter):
    settings, catalog = kafka
    settings = settings.model_copy(update={"media_allow_networks": ("127.0.0.1/32",)})
    mocker = MockerConfig(block_size=16)
    encoder = EncodeWorker(steady(settings), EncodeWorkerConfig(worker_id="enc0", slot=0, model=MODEL),
                           build_media_encoder(DEFAULT_MEDIA_HIDDEN_SIZE), catalog)
    metrics = encode_registry(encoder)

    def sample(name: str) -> float:
        return metrics.get_sample_value(name, {"worker_id": "enc0"})

    async with serve_app(_media_app()) as media, \
            in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker, policy="kv") as (router, _, client):
        encoding = asyncio.create_task(encoder.slot.run())
        try:
            await waiter(lambda: "enc0" in router.table.workers, timeout_s=60)
            async with serve_bridge(settings, catalog, BRIDGE_SLOT) as (url, bridge), \
                    httpx.AsyncClient(base_url=url, timeout=120) as http:
                await waiter(lambda: bridge.registry.media_tokens(MODEL) == encoder.encoder.media_tokens,
                             timeout_s=60)

                async def ask(image: str) -> dict:
                    reply = await http.post("/v1/chat/completions", json=_chat(f"{media}/{image}"))
                    assert reply.status_code == 200, reply.text
                    return reply.json()["kvflow"]

                # Keep one worker busy so the first image lands on the other (the one
                # an idle tie-break may not pick).
                long = client.new_request(MODEL, prompt="busy " * 40,
                                          sampling=SamplingParams(max_tokens=100_000, ignore_eos=True))
                busy = client.stream(long)
                head = await busy.__anext__()
                holder = ({"w0", "w1"} - {head.worker_id}).pop()
                first = await ask("a.png")
                assert first["worker_id"] == holder and first["overlap_blocks"] == 0
                assert (sample("kvflow_encode_cache_misses_total"), sample("kvflow_encode_cache_hits_total")) == (1, 0)
                await client.cancel(long.request_id)
                async for event in busy:
                    if isinstance(event, FinalResponse):
                        break
                await waiter(lambda: all(router.table.workers[w].load == 0 for w in ("w0", "w1")), timeout_s=60)

                # Both idle: the image's blocks bring it back to the worker holding them.
                again = await ask("a.png")
                assert again["worker_id"] == holder and again["overlap_blocks"] >= 2
                assert (sample("kvflow_encode_cache_misses_total"), sample("kvflow_encode_cache_hits_total")) == (1, 1)
                assert sample("kvflow_encode_cache_entries") == 1 and sample("kvflow_encode_cache_bytes") > 0

                # Another image, the same token ids: its content hash keeps every block apart.
                other = await ask("b.png")
                assert other["overlap_blocks"] == 0
                assert sample("kvflow_encode_cache_misses_total") == 2

                junk = await http.post("/v1/chat/completions", json=_chat(f"{media}/junk.png"))
                assert junk.status_code == 400 and junk.json()["error"]["code"] == "invalid_media", junk.text
                assert metrics.get_sample_value("kvflow_encode_requests_total",
                                                {"worker_id": "enc0", "outcome": "refused"}) == 1

                topic = catalog.queue(WorkerRole.encode).name
                producer = make_producer(settings)
                await producer.start()
                try:
                    await producer.send_and_wait(topic, b"{not a request", key=b"junk", partition=0)
                finally:
                    await producer.stop()
                letter = await _dead_letter_of(settings, catalog, topic)
                assert letter.consumer == "enc0" and letter.value == "{not a request"
                assert (await ask("a.png"))["worker_id"] == "w1"  # the encode worker goes on
                assert sample("kvflow_encode_cache_hits_total") == 2
        finally:
            encoder.slot.stop()
            await encoding


async def test_kvflow_up_runs_encode_workers(kafka):
    """The processes `kvflow up --encode-workers 1` starts: a mocker worker and an
    encode worker process (its Prometheus series on the worker metrics URL)."""
    import base64

    from deployment import wait_bridge_healthy
    from kvflow.streams.broker import free_port
    from kvflow.supervisor import Supervisor, WorkerSpec

    settings, _ = kafka
    sup = Supervisor(steady(settings).model_copy(update={"metrics_port": 0}), WorkerSpec(engine="mocker", model=MODEL),
                     port=free_port())
    await sup.start()
    try:
        await sup.start_worker(WorkerRole.aggregated)
        await sup.start_worker(WorkerRole.encode)
        await sup.wait_workers_ready(2, timeout_s=120)
        # The worker processes announce the TTL this test's settings give, not their own default.
        assert all(w.ttl_ms >= STEADY_WORKER_TTL_MS for w in sup.router.table.workers.values())
        await wait_bridge_healthy(sup.url)
        image = "data:image/png;base64," + base64.b64encode(_png((0, 200, 0))).decode()
        async with httpx.AsyncClient(timeout=120) as http:
            for _ in range(2):
                reply = await http.post(f"{sup.url}/v1/chat/completions", json=_chat(image))
                assert reply.status_code == 200, reply.text
            (encode_url,) = [c.metrics_url for c in sup.children.values() if c.role is WorkerRole.encode]
            exposition = (await http.get(encode_url)).text
        assert "kvflow_encode_cache_misses_total" in exposition
        assert any(line.startswith("kvflow_encode_cache_hits_total") and line.endswith(" 1.0")
                   for line in exposition.splitlines()), exposition
    finally:
        await sup.stop()
