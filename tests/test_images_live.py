"""/v1/images/generations over the real embedded broker: bridge →
queue.conditioning → text-stage worker process → queue.diffusion →
image-stage worker process → responses → bridge, with httpx and the
`openai` package as clients; the stage records read back from their topics,
the image stage replayed alone from them, and malformed stage records
dead-lettered."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from aiokafka import TopicPartition
from typer.testing import CliRunner

pytest.importorskip("diffusers")

from deployment import steady, wait_bridge_healthy, wait_models  # noqa: E402
from test_images import pixels  # noqa: E402

from kvflow.cli import app  # noqa: E402
from kvflow.models.image import TINY_IMAGE_MODEL  # noqa: E402
from kvflow.schemas import (  # noqa: E402
    DeadLetter,
    ImageConditioning,
    ImageRequest,
    ImageResult,
    ResponseEvent,
    WorkerRole,
    decode,
)
from kvflow.streams.broker import free_port  # noqa: E402
from kvflow.streams.history import read_topic  # noqa: E402
from kvflow.streams.kafka import make_consumer, make_producer  # noqa: E402
from kvflow.supervisor import Supervisor, WorkerSpec  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
async def deployment(kafka):
    """Router and bridge in this process, one worker process per image stage (what
    `kvflow up --workers 0 --image-workers 1` starts), on the test's broker."""
    settings, _ = kafka
    sup = Supervisor(steady(settings), WorkerSpec(image_model=TINY_IMAGE_MODEL), port=free_port())
    await sup.start()
    try:
        await sup.start_worker(WorkerRole.conditioning)
        await sup.start_worker(WorkerRole.diffusion)
        await sup.wait_workers_ready(2, timeout_s=120)
        await wait_bridge_healthy(sup.url)
        await wait_models(sup.url, [TINY_IMAGE_MODEL])
        yield sup
    finally:
        await sup.stop()


async def records_of(settings, spec, schema, request_ids) -> dict[str, object]:
    """The records of ``request_ids`` on topic ``spec`` (each decoded with ``schema``), by request id."""
    found = {}
    for msg in await read_topic(settings, spec):
        record = decode(schema, msg.value)
        if record.request_id in request_ids:
            found[record.request_id] = record
    return found


async def dead_letters(settings, catalog, topics: set[str], timeout_s: float = 60.0) -> list[DeadLetter]:
    """The dead letters of ``topics``, once there is at least one of each."""
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    found: list[DeadLetter] = []
    try:
        tp = TopicPartition(catalog.dead_letter.name, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not topics <= {d.source_topic for d in found}:
            assert asyncio.get_running_loop().time() < deadline, f"dead letters: {found}"
            for records in (await consumer.getmany(tp, timeout_ms=200)).values():
                found.extend(d for d in (decode(DeadLetter, m.value) for m in records) if d.source_topic in topics)
    finally:
        await consumer.stop()
    return found


async def test_images_api_over_kafka(deployment, kafka, tmp_path):
    settings, catalog = kafka
    url = deployment.url
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        reply = await http.post("/v1/images/generations", json={
            "model": TINY_IMAGE_MODEL, "prompt": "a red fox in the snow", "n": 2, "size": "32x32", "seed": 7,
            "response_format": "b64_json"})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        rid = reply.headers["x-request-id"]
        assert len(body["data"]) == 2 and body["size"] == "32x32" and body["output_format"] == "png"
        assert body["kvflow"]["seed"] == 7 and body["kvflow"]["num_inference_steps"] == 3
        first, second = (pixels(d["b64_json"]) for d in body["data"])
        assert first.shape == second.shape == (32, 32, 3) and not np.array_equal(first, second)

        # No model named: the only image model; no seed: one is drawn and reported.
        unseeded = await http.post("/v1/images/generations", json={"prompt": "a lighthouse"})
        assert unseeded.status_code == 200, unseeded.text
        assert unseeded.json()["size"] == "64x64" and isinstance(unseeded.json()["kvflow"]["seed"], int)

        bad = [({"prompt": "x", "size": "30x30"}, "size"), ({"prompt": "x", "size": "big"}, "size"),
               ({"prompt": "x", "size": "4096x4096"}, "size"), ({"prompt": "x", "n": 11}, "n"),
               ({"prompt": "x", "n": 0}, "n"), ({"prompt": ""}, "prompt"), ({"n": 1}, "prompt"),
               ({"prompt": "x", "response_format": "url"}, "response_format"),
               ({"prompt": "x", "output_format": "jpeg"}, "output_format"), ({"prompt": "x", "seed": -1}, "seed"),
               ({"prompt": "x", "size": "512x512"}, "size")]  # over the tiny pipeline's 256 pixels: the worker says
        for request_body, param in bad:
            r = await http.post("/v1/images/generations", json={"model": TINY_IMAGE_MODEL, **request_body})
            assert r.status_code == 400, (request_body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
        missing = await http.post("/v1/images/generations", json={"model": "no-such-model", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        chat = await http.post("/v1/chat/completions", json={"model": TINY_IMAGE_MODEL,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    sdk = await client.images.generate(model=TINY_IMAGE_MODEL, prompt="a red fox in the snow", size="32x32",
                                       response_format="b64_json", extra_body={"seed": 7})
    # Seed 7 draws the noise of the first image of the batch above first: the same image (up to
    # rounding, as a batch of one runs other kernels).
    assert len(sdk.data) == 1 and np.abs(pixels(sdk.data[0].b64_json).astype(int) - first.astype(int)).max() <= 1
    with pytest.raises(openai.BadRequestError):
        await client.images.generate(model=TINY_IMAGE_MODEL, prompt="x", n=11)

    # Each stage's record is on its topic: the request, the conditioning, the images.
    requests = await records_of(settings, catalog.queue(WorkerRole.conditioning), ImageRequest, {rid})
    conditioning = await records_of(settings, catalog.queue(WorkerRole.diffusion), ImageConditioning, {rid})
    answers = await records_of(settings, catalog.responses, ResponseEvent, {rid})
    assert requests[rid].prompt == "a red fox in the snow" and requests[rid].seed == 7 and requests[rid].n == 2
    assert conditioning[rid].request == requests[rid]
    workers = {c.role: c.worker_id for c in deployment.children.values()}
    assert conditioning[rid].worker_id == workers[WorkerRole.conditioning]
    assert isinstance(answers[rid], ImageResult) and answers[rid].worker_id == workers[WorkerRole.diffusion]
    assert answers[rid].images == [d["b64_json"] for d in body["data"]]

    # The image stage replayed alone, in this process, from the recorded conditioning (`kvflow replay-images`).
    out = tmp_path / "replayed"
    replay = await asyncio.to_thread(CliRunner().invoke, app, [
        "replay-images", rid, "--out", str(out), "--bootstrap-servers", settings.bootstrap_servers,
        "--namespace", settings.namespace])
    assert replay.exit_code == 0, replay.output
    line = json.loads(replay.output.strip().splitlines()[-1])
    assert line["request_id"] == rid and line["seed"] == 7 and line["size"] == "32x32" and line["error"] is None
    assert [Path(f).name for f in line["files"]] == [f"{rid}-0.png", f"{rid}-1.png"]
    # The same PNG files: the tiny pipeline runs one torch thread in the worker and here alike.
    assert [Path(f).read_bytes() for f in line["files"]] == [base64.b64decode(d["b64_json"]) for d in body["data"]]

    # A malformed record on either stage's queue is dead-lettered by its worker, which goes on.
    slots = {c.role: c.slot for c in deployment.children.values()}
    producer = make_producer(settings)
    await producer.start()
    try:
        for role in (WorkerRole.conditioning, WorkerRole.diffusion):
            await producer.send_and_wait(catalog.queue(role).name, b"{not a record", key=b"junk", partition=slots[role])
    finally:
        await producer.stop()
    topics = {catalog.queue(role).name for role in (WorkerRole.conditioning, WorkerRole.diffusion)}
    letters = await dead_letters(settings, catalog, topics)
    assert {(d.source_topic, d.consumer, d.value) for d in letters} == {
        (catalog.queue(role).name, workers[role], "{not a record")
        for role in (WorkerRole.conditioning, WorkerRole.diffusion)}
    after = await client.images.generate(model=TINY_IMAGE_MODEL, prompt="still serving", size="16x16")
    assert pixels(after.data[0].b64_json).shape == (16, 16, 3)
