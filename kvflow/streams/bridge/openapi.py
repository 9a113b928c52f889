"""The bridge's OpenAPI schema, with the request bodies its routes parse themselves.

``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/embeddings`` and
``/v1/images/generations`` read the raw body (to bound its size while it streams in, see
:mod:`kvflow.streams.bridge.body`), so
FastAPI cannot see their body models. :func:`install_openapi` adds them:
each operation's ``requestBody`` refers to the JSON schema of its pydantic
model (:mod:`kvflow.schemas.openai`), bounds included, so clients and
schema-driven fuzzers see what the bridge accepts. The headers those routes
read (the request timeout, ``Last-Event-ID``) are added as parameters.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvflow.schemas.openai import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest, ErrorResponse
from kvflow.schemas.openai_images import ImagesRequest
from kvflow.schemas.openai_responses import ResponsesRequest

__all__ = ["REQUEST_BODIES", "ERROR_RESPONSES", "REQUEST_HEADERS", "install_openapi"]

REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/embeddings", "post"): EmbeddingsRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/v1/images/generations", "post"): ImagesRequest,
}
"""(path, method) → the model its JSON body is validated against."""

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request: bad JSON, a field out of bounds, an "
                                                 "unsupported feature, or prompt plus output over the context."},
    401: {"model": ErrorResponse, "description": "Missing or unknown API key (code `invalid_api_key`)."},
    404: {"model": ErrorResponse, "description": "No worker serves the model (code `model_not_found`), or "
                                                 "`Last-Event-ID` names no stream (code `stream_not_found`)."},
    413: {"model": ErrorResponse, "description": "Body or prompt over the configured limit."},
    503: {"model": ErrorResponse, "description": "No live worker for the model right now; see Retry-After."},
    504: {"model": ErrorResponse, "description": "The request's deadline passed before its answer "
                                                 "(code `deadline_exceeded`)."},
}
"""Error answers of the inference routes (``responses=`` of their routers)."""


REQUEST_HEADERS: list[dict[str, Any]] = [
    {"name": "X-Request-Timeout", "in": "header", "required": False,
     "description": "Seconds from arrival to the request's deadline (the smaller of this and the body's "
                    "`timeout_s` wins); default: derived from max_tokens.",
     "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}},
    {"name": "Last-Event-ID", "in": "header", "required": False,
     "description": "Resume a stream after this event (an SSE `id` of an earlier answer to the same body): "
                    "nothing is sent again, the rest of the stream follows.",
     "schema": {"type": "string"}},
]
"""Headers the inference routes read (``parameters`` of their operations)."""


def install_openapi(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]] | None = None) -> None:
    """Make ``app.openapi()`` describe ``bodies`` (default :data:`REQUEST_BODIES`)
    as required JSON request bodies; their schemas go under
    ``components/schemas``. The schema is built once and cached on the app.

    Raises:
        KeyError: (when the schema is first built) a path/method in
            ``bodies`` is not a route of ``app``.
    """
    bodies = REQUEST_BODIES if bodies is None else bodies

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                             summary=app.summary, description=app.description, routes=app.routes)
        refs, defs = models_json_schema([(model, "validation") for model in bodies.values()],
                                        ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for (path, method), model in bodies.items():
            schema["paths"][path][method]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
            schema["paths"][path][method].setdefault("parameters", []).extend(REQUEST_HEADERS)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
