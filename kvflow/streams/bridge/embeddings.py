"""The request path of ``/v1/embeddings``.

Steps: read the body (size limit) → parse and validate → check the model
against the embedding workers of the live-worker projection (404/503; 400
for a model that only generates text) → pick the least loaded embedding
worker (its heartbeat's queue plus what this bridge sent it since) → send
an :class:`~kvflow.schemas.EmbeddingRequest` to that worker's slot of
``queue.embedding`` and wait for its :class:`~kvflow.schemas.EmbeddingResult`
→ answer the OpenAI ``list`` of ``embedding`` objects, floats or base64.

No router is involved: an encoder keeps no KV between requests, so there is
no cache overlap to route by.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request, Response

from kvflow.schemas import EmbeddingRequest, EmbeddingResult, now_ms
from kvflow.schemas.openai import EmbeddingObject, EmbeddingsRequest, EmbeddingsResponse, EmbeddingsUsage
from kvflow.streams.bridge.body import read_body
from kvflow.streams.bridge.deadline import timeout_for
from kvflow.streams.bridge.direct import least_loaded, send_direct, serve_direct
from kvflow.streams.bridge.errors import from_error_info, invalid_request, model_not_found, no_live_workers
from kvflow.streams.bridge.openai_format import parse_body
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.worker_registry import ModelState
from kvflow.streams.deadlines import deadline_ms
from kvflow.streams.workers import WorkerView

__all__ = ["ENDPOINT", "serve_embeddings", "encode_vector"]

ENDPOINT = "embeddings"
"""Endpoint label of ``/v1/embeddings`` (Prometheus ``endpoint``)."""


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """One vector as the API sends it: floats, or (``base64``) the base64 of
    its little-endian float32 bytes (what the OpenAI SDK decodes with
    ``np.frombuffer(..., dtype="float32")``)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def _pick_worker(state: BridgeState, model: str) -> WorkerView:
    """The embedding worker of ``model`` with the fewest requests waiting
    (heartbeat figures plus this bridge's unanswered sends), lowest id on ties.

    Raises:
        BridgeError: 404 unknown model; 400 a model served only for text
            generation; 503 no live embedding worker.
    """
    registry = state.registry
    if state.refresh_workers is not None and registry.model_state(model, embedding=True) is not ModelState.serving:
        await state.refresh_workers(model)  # a worker may have just started
    workers = registry.embedding_workers(model)
    if not workers:
        if registry.model_state(model) is ModelState.serving:
            raise invalid_request(f"The model `{model}` generates text; it serves no embeddings.",
                                  param="model", code="model_not_supported")
        if registry.model_state(model, embedding=True) is ModelState.unknown:
            raise model_not_found(model)
        raise no_live_workers(model, state.retry_after_s)
    return least_loaded(workers, state.embeddings_sent)


async def _answer(state: BridgeState, http_request: Request) -> Response:
    raw = await read_body(http_request, state.max_body_bytes)
    body, _ = parse_body(raw, EmbeddingsRequest)
    texts, token_ids = body.inputs()
    worker = await _pick_worker(state, body.model)
    timeout_s = timeout_for(state.settings, http_request.headers, body, 1)
    created = now_ms()
    request = EmbeddingRequest(request_id=f"emb-{uuid.uuid4().hex}", model=body.model, texts=texts,
                               token_ids=token_ids, dimensions=body.dimensions, reply_to=state.source.reply_to,
                               created_ms=created, deadline_ms=deadline_ms(created, timeout_s))
    result: EmbeddingResult = await send_direct(state, "embed", request, worker.queue_partition, through=[worker],
                                                sent=state.embeddings_sent, timeout_s=timeout_s, what="embeddings")
    if result.error is not None:
        raise from_error_info(result.error)
    data = [EmbeddingObject(index=i, embedding=encode_vector(v, body.encoding_format))
            for i, v in enumerate(result.embeddings)]
    answer = EmbeddingsResponse(data=data, model=result.model or body.model,
                                usage=EmbeddingsUsage(prompt_tokens=result.prompt_tokens,
                                                      total_tokens=result.prompt_tokens))
    return Response(answer.model_dump_json(), media_type="application/json",
                    headers={"X-Request-Id": request.request_id})


async def serve_embeddings(state: BridgeState, http_request: Request) -> Response:
    """Answer one embeddings request: the OpenAI ``list`` object or an OpenAI
    error (:func:`~kvflow.streams.bridge.direct.serve_direct`).

    Never raises for client mistakes; unexpected exceptions propagate to the
    app's last-resort handler (500).
    """
    return await serve_direct(state, http_request, ENDPOINT, _answer)
