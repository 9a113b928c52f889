"""The request path of ``/v1/images/generations``.

Steps: read the body (size limit) → parse and validate (400: bad size, n
out of 1..10, empty prompt, ``response_format: url``) → the model (the
body's, or the only image model served) → pick the least loaded worker of
each image stage from the live-worker projection (404/503; 400 for a model
that only generates text or embeddings) → send an
:class:`~kvflow.schemas.ImageRequest` naming the diffusion worker's slot to
the text-stage worker's slot of ``queue.conditioning``, and wait for the
:class:`~kvflow.schemas.ImageResult` the diffusion worker answers on this
bridge's responses slot → answer the OpenAI images object (base64 PNGs).

No router is involved: neither stage keeps KV between requests. The stages'
records are on their queue topics, so either can be replayed alone
(:mod:`kvflow.replay.images`).
"""

from __future__ import annotations

import math
import secrets
import uuid

from fastapi import Request, Response

from kvflow.schemas import ImageRequest, ImageResult, WorkerRole, now_ms
from kvflow.schemas.openai_images import ImageData, ImagesKvflowInfo, ImagesRequest, ImagesResponse
from kvflow.streams.bridge.body import read_body
from kvflow.streams.bridge.deadline import timeout_for
from kvflow.streams.bridge.direct import least_loaded, send_direct, serve_direct
from kvflow.streams.bridge.errors import BridgeError, from_error_info, invalid_request, model_not_found, no_live_workers
from kvflow.streams.bridge.openai_format import parse_body
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.worker_registry import ModelState
from kvflow.streams.deadlines import deadline_ms
from kvflow.streams.workers import WorkerView

__all__ = ["ENDPOINT", "SEED_RANGE", "serve_images"]

ENDPOINT = "images"
"""Endpoint label of ``/v1/images/generations`` (Prometheus ``endpoint``)."""

SEED_RANGE = 2**32
"""Seeds the bridge draws for requests that set none lie in ``[0, SEED_RANGE)``."""


def _check_supported(body: ImagesRequest) -> None:
    """Refuse output kvflow does not produce.

    Raises:
        BridgeError: 400 ``unsupported``: ``response_format`` url, or an ``output_format`` other than png.
    """
    if body.response_format == "url":
        raise invalid_request("response_format `url` is not supported: kvflow keeps no image files to link to; "
                              "use `b64_json`.", param="response_format", code="unsupported")
    if body.output_format not in (None, "png"):
        raise invalid_request(f"output_format `{body.output_format}` is not supported; kvflow sends PNG.",
                              param="output_format", code="unsupported")


async def _model(state: BridgeState, body: ImagesRequest) -> str:
    """The body's model, or the only image model served when it names none.

    Raises:
        BridgeError: 400 several image models are served and the body names none;
            503 none is served.
    """
    if body.model is not None:
        return body.model
    models = state.registry.image_models()
    if len(models) == 1:
        return models[0]
    if models:
        raise invalid_request(f"`model` is required: this deployment serves several image models "
                              f"({', '.join(models)}).", param="model", code="missing_required_parameter")
    raise BridgeError(503, "No live workers serve an image model; retry later.", "service_unavailable",
                      code="no_live_workers", headers={"Retry-After": str(max(1, math.ceil(state.retry_after_s)))})


async def _pick_workers(state: BridgeState, model: str) -> tuple[WorkerView, WorkerView]:
    """(text-stage worker, image-stage worker) of ``model``.

    Raises:
        BridgeError: 404 unknown model; 400 a model served for text or
            embeddings only; 503 a stage has no live worker.
    """
    registry = state.registry
    if state.refresh_workers is not None and registry.model_state(model, image=True) is not ModelState.serving:
        await state.refresh_workers(model)  # a worker may have just started
    if registry.model_state(model, image=True) is not ModelState.serving:
        if ModelState.serving in (registry.model_state(model), registry.model_state(model, embedding=True)):
            raise invalid_request(f"The model `{model}` serves text or embeddings, not images.", param="model",
                                  code="model_not_supported")
        if registry.model_state(model, image=True) is ModelState.unknown:
            raise model_not_found(model)
        raise no_live_workers(model, state.retry_after_s)
    return (least_loaded(registry.stage_workers(model, WorkerRole.conditioning), state.stage_sent),
            least_loaded(registry.stage_workers(model, WorkerRole.diffusion), state.stage_sent))


async def _answer(state: BridgeState, http_request: Request) -> Response:
    raw = await read_body(http_request, state.max_body_bytes)
    body, _ = parse_body(raw, ImagesRequest)
    _check_supported(body)
    width, height = body.dimensions() or (None, None)
    model = await _model(state, body)
    workers = await _pick_workers(state, model)
    timeout_s = timeout_for(state.settings, http_request.headers, body, 1)  # type: ignore[arg-type]
    created = now_ms()
    request = ImageRequest(
        request_id=f"img-{uuid.uuid4().hex}", model=model, prompt=body.prompt, n=body.n, width=width, height=height,
        seed=secrets.randbelow(SEED_RANGE) if body.seed is None else body.seed,
        num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
        diffusion_partition=workers[1].queue_partition, reply_to=state.source.reply_to, created_ms=created,
        deadline_ms=deadline_ms(created, timeout_s))
    # The request counts on both stages' workers until its image comes back.
    result: ImageResult = await send_direct(state, "generate_image", request, workers[0].queue_partition,
                                            through=workers, sent=state.stage_sent, timeout_s=timeout_s,
                                            what="image")
    if result.error is not None:
        raise from_error_info(result.error)
    answer = ImagesResponse(
        created=created // 1000, data=[ImageData(b64_json=png) for png in result.images],
        size=f"{result.width}x{result.height}",
        kvflow=ImagesKvflowInfo(seed=result.seed, num_inference_steps=result.num_inference_steps, width=result.width,
                                height=result.height, prompt_tokens=result.prompt_tokens,
                                diffusion_worker_id=result.worker_id))
    return Response(answer.model_dump_json(), media_type="application/json",
                    headers={"X-Request-Id": request.request_id})


async def serve_images(state: BridgeState, http_request: Request) -> Response:
    """Answer one image generation request: the OpenAI images object or an
    OpenAI error (:func:`~kvflow.streams.bridge.direct.serve_direct`).

    Never raises for client mistakes; unexpected exceptions propagate to the
    app's last-resort handler (500).
    """
    return await serve_direct(state, http_request, ENDPOINT, _answer)
