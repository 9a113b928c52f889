"""Prompt embeddings: a prompt's own token embeddings give the same greedy
output as the prompt (hf engine on SmolLM2-135M-Instruct), shape and dtype
are checked (400), and routing keys their KV blocks by the embedding bytes
(a repeated embeddings prompt is routed to, and served from, its cached
blocks) — end to end through the bridge, the router and an hf worker process
on the real embedded broker."""

from __future__ import annotations

import base64
import io
import uuid

import httpx
import pytest
import torch

from deployment import running_deployment
from kvflow.schemas import SamplingParams
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import create_topics
from kvflow.supervisor import WorkerSpec
from kvflow.workers.engines.base import EngineConfig, EngineError, GenerateRequest
from kvflow.workers.engines.hf import HfEngine
from kvflow.workers.prompt_embeds import to_tensor

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made and")


def b64_tensor(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
async def engine():
    eng = HfEngine(EngineConfig(model=MODEL))
    await eng.start()
    yield eng
    await eng.stop()


def token_embeddings(eng: HfEngine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return eng._model.get_input_embeddings()(torch.tensor(ids)).detach().clone()  # [ISL, hidden]


async def run(eng: HfEngine, request: GenerateRequest) -> list[int]:
    return [t async for out in eng.generate(request) for t in out.token_ids]


async def test_engine_gives_the_same_greedy_output_for_a_prompts_own_embeddings(engine):
    ids = engine.tokenizer.encode_prompt(PROMPT)
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = await run(engine, GenerateRequest("ids", ids, sampling))
    embeds = PromptEmbeds.of(token_embeddings(engine, ids).numpy().tobytes(), (len(ids), 576), "float32")
    tensor = to_tensor(embeds)
    assert tensor.dtype is torch.float32 and tuple(tensor.shape) == (len(ids), 576)
    from_embeds = await run(engine, GenerateRequest("embeds", embeds.row_ids(), sampling, prompt_embeds=tensor))
    assert from_embeds == plain and len(plain) == 16
    # Again: served from the prefix cache its first run filled (keyed by row ids), same output.
    again = [o async for o in engine.generate(GenerateRequest("again", embeds.row_ids(), sampling,
                                                              prompt_embeds=tensor))]
    assert [t for o in again for t in o.token_ids] == plain
    assert again[0].num_cached_tokens >= 16

    with pytest.raises(EngineError, match="shape"):
        await run(engine, GenerateRequest("wide", embeds.row_ids(), sampling,
                                          prompt_embeds=torch.zeros(len(ids), 577)))
    with pytest.raises(EngineError, match="dtype"):
        await run(engine, GenerateRequest("half", embeds.row_ids(), sampling, prompt_embeds=tensor.half()))


@pytest.fixture(scope="module")
async def hf_deployment(broker):
    settings = Settings(bootstrap_servers=broker.bootstrap_servers, embedded_broker=True,
                        namespace=f"pe{uuid.uuid4().hex[:8]}", session_timeout_ms=2000)
    await create_topics(settings, Catalog(settings.namespace))
    async with running_deployment(settings, WorkerSpec(engine="hf", model=MODEL), workers=1,
                                  ready_timeout_s=240) as sup:
        yield sup


async def test_completions_with_prompt_embeds_over_kafka(hf_deployment, engine):
    ids = engine.tokenizer.encode_prompt(PROMPT)
    embeds = b64_tensor(token_embeddings(engine, ids))
    common = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    async with httpx.AsyncClient(base_url=hf_deployment.url, timeout=120) as http:
        plain = (await http.post("/v1/completions", json={**common, "prompt": ids})).json()
        first = await http.post("/v1/completions", json={**common, "prompt_embeds": embeds})
        assert first.status_code == 200, first.text
        first = first.json()
        assert first["choices"][0]["text"] == plain["choices"][0]["text"]
        assert first["usage"]["prompt_tokens"] == len(ids)
        # The router hashed the embedding rows: the repeat is routed onto its cached blocks.
        second = (await http.post("/v1/completions", json={**common, "prompt_embeds": embeds})).json()
        assert second["choices"][0]["text"] == plain["choices"][0]["text"]
        assert second["kvflow"]["overlap_blocks"] >= 1
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16

        rows = token_embeddings(engine, ids)
        bad = {
            "not base64": "%%%",
            "not a tensor": base64.b64encode(b"hello").decode(),
            "3-D": b64_tensor(rows.unsqueeze(0)),
            "int": b64_tensor(torch.ones(4, 576, dtype=torch.int32)),
            "nan": b64_tensor(torch.full((4, 576), float("nan"))),
            "empty": b64_tensor(torch.zeros(0, 576)),
            "hidden size": b64_tensor(torch.zeros(4, 100)),
            "dtype": b64_tensor(rows.half()),
            "not a tensor object": b64_tensor({"x": 1}),
        }
        for what, value in bad.items():
            r = await http.post("/v1/completions", json={**common, "prompt_embeds": value})
            assert r.status_code == 400, (what, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error", (what, r.text)
        both = await http.post("/v1/completions", json={**common, "prompt": "hi", "prompt_embeds": embeds})
        assert both.status_code == 400
        echo = await http.post("/v1/completions", json={**common, "prompt_embeds": embeds, "echo": True})
        assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
