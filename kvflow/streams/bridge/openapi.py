"""The bridge's OpenAPI schema, with the request bodies its routes parse themselves.

``/v1/chat/completions`` and ``/v1/completions`` read the raw body (to bound
its size while it streams in, see :mod:`kvflow.streams.bridge.body`), so
FastAPI cannot see their body models. :func:`install_openapi` adds them:
each operation's ``requestBody`` refers to the JSON schema of its pydantic
model (:mod:`kvflow.schemas.openai`), bounds included, so clients and
schema-driven fuzzers see what the bridge accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvflow.schemas.openai import ChatCompletionRequest, CompletionRequest, ErrorResponse

__all__ = ["REQUEST_BODIES", "ERROR_RESPONSES", "install_openapi"]

REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
}
"""(path, method) → the model its JSON body is validated against."""

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request: bad JSON, a field out of bounds, an "
                                                 "unsupported feature, or prompt plus output over the context."},
    401: {"model": ErrorResponse, "description": "Missing or unknown API key (code `invalid_api_key`)."},
    404: {"model": ErrorResponse, "description": "No worker serves the model (code `model_not_found`)."},
    413: {"model": ErrorResponse, "description": "Body or prompt over the configured limit."},
    503: {"model": ErrorResponse, "description": "No live worker for the model right now; see Retry-After."},
}
"""Error answers of the inference routes (``responses=`` of their routers)."""


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
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
