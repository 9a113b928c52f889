"""Schema-driven fuzzing of the HTTP bridge: no generated input gets a 5xx.

Schemathesis reads the bridge's own OpenAPI schema (request bodies included,
see :mod:`kvflow.streams.bridge.openapi`) and sends every operation inputs
that fit it and inputs that break it (wrong types, out-of-range numbers,
missing fields, junk). Each answer goes through schemathesis'
``not_a_server_error`` check.

The app is the real bridge (parsing, bounds, tokenizing with the byte
tokenizer, the live-worker projection, response shaping, metrics) over a
Kafka-less state whose response source answers from ``TinyEngine`` below:
this test checks the HTTP contract, not the pipeline. Generation is bounded
(``max-examples`` per operation and phase) and deterministic.
"""

from __future__ import annotations

from collections import Counter

import schemathesis
from schemathesis.checks import not_a_server_error
from test_bridge_unit import MODEL, REPLY_TO, Clock, heartbeat

from kvflow.models.tokenizer import ByteTokenizer
from kvflow.schemas import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    ImageRequest,
    ImageResult,
    InferenceRequest,
    TokenDelta,
    Usage,
    WorkerRole,
)
from kvflow.schemas.requests import MAX_TOKENS_LIMIT
from kvflow.settings import Settings
from kvflow.streams.bridge import build_app_for_state
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.worker_registry import WorkerRegistry

CONFIG = schemathesis.Config.from_str("""
seed = 1337

[generation]
max-examples = 30
deterministic = true
database = "none"
""")


class TinyEngine:
    """A response source that "generates" by reading the prompt backwards.

    Output token ``i`` is the prompt's ``i``-th token from the end (cycling),
    at most ``sampling.max_tokens`` of them (and at most 8), each sent as one
    :class:`TokenDelta`, then a :class:`FinalResponse` with the usage.
    """

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.requests = 0

    @property
    def reply_to(self):
        """The responses partition this source reads (a fixed one)."""
        return REPLY_TO

    async def stream(self, request: InferenceRequest):
        """Yield the request's deltas and final record."""
        self.requests += 1
        prompt = request.token_ids or [self.tokenizer.NUM_SPECIAL]
        count = min(request.sampling.max_tokens, 8)
        output = [prompt[-1 - i % len(prompt)] for i in range(count)]
        for i, token in enumerate(output):
            yield TokenDelta(request_id=request.request_id, index=i, token_ids=[token],
                             text=self.tokenizer.decode([token]), worker_id="w0")
        yield FinalResponse(request_id=request.request_id, text=self.tokenizer.decode(output), token_ids=output,
                            finish_reason=FinishReason.length, worker_id="w0",
                            usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(output)))


    async def embed(self, request: EmbeddingRequest, partition: int) -> EmbeddingResult:
        """Answer an embeddings request with 8-dimensional vectors (an error above 8 dimensions)."""
        dim = request.dimensions or 8
        if dim > 8:
            return EmbeddingResult(request_id=request.request_id, error=ErrorInfo(
                message=f"dimensions {dim} exceeds the model's 8", type="invalid_request_error",
                code="invalid_value", status=400, param="dimensions"))
        return EmbeddingResult(request_id=request.request_id, model=request.model, prompt_tokens=request.num_inputs,
                               embeddings=[[1.0 / dim ** 0.5] * dim for _ in range(request.num_inputs)])

    async def generate_image(self, request: ImageRequest, partition: int) -> ImageResult:
        """Answer an image request with ``n`` copies of a one-pixel PNG (the size it asked for, or 8x8)."""
        return ImageResult(request_id=request.request_id, model=request.model, images=[ONE_PIXEL_PNG] * request.n,
                           width=request.width or 8, height=request.height or 8, seed=request.seed)


ONE_PIXEL_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC")
"""Base64 of a 1x1 RGB PNG."""

ENGINE = TinyEngine()
STATE = BridgeState(settings=Settings(max_prompt_tokens=4096), source=ENGINE,
                    registry=WorkerRegistry(clock=Clock()))
STATE.registry.apply(heartbeat(context_length=2048))
# The same model name on an embedding worker: embeddings bodies travel on to TinyEngine.embed too.
STATE.registry.apply(heartbeat(worker_id="e0", role=WorkerRole.embedding, queue_topic="ns.queue.embedding"))
# And on both image stages: image bodies travel on to TinyEngine.generate_image.
for _stage in (WorkerRole.conditioning, WorkerRole.diffusion):
    STATE.registry.apply(heartbeat(worker_id=f"{_stage.value[:3]}0", role=_stage,
                                   queue_topic=f"ns.queue.{_stage.value}"))
APP = build_app_for_state(STATE)
STATUSES: Counter[int] = Counter()

schema = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG)


@schema.parametrize()
def test_no_generated_input_gets_a_server_error(case):
    # Most generated model names are unknown (404); naming the served model
    # lets a body travel on through tokenizing, bounds and the engine.
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    response = case.call()
    STATUSES[response.status_code] += 1
    case.validate_response(response, checks=[not_a_server_error])


def test_openapi_schema_describes_the_request_bodies():
    spec = APP.openapi()
    for path, name in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert spec["paths"][path]["post"]["security"] == [{"HTTPBearer": []}]
    completion = spec["components"]["schemas"]["CompletionRequest"]
    assert completion["required"] == ["model"]  # and one of prompt, prompt_embeds
    assert {"prompt", "prompt_embeds"} <= set(completion["properties"])
    assert completion["properties"]["max_tokens"]["anyOf"][0]["maximum"] == MAX_TOKENS_LIMIT
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/_Message"}
    assert chat["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert "_Message" in spec["components"]["schemas"] and "HTTPBearer" in spec["components"]["securitySchemes"]
    assert "requestBody" not in spec["paths"]["/health"]["get"]
