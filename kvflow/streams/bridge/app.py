"""Wiring of the OpenAI-compatible HTTP bridge: routes, error handlers, lifespan.

Run it with uvicorn::

    app = build_app(Settings(bootstrap_servers="127.0.0.1:9092"))
    await uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=8000)).serve()
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from kvflow.settings import Settings
from kvflow.streams.bridge.api_keys import configured_api_keys, log_auth_mode
from kvflow.streams.bridge.errors import install_error_handlers
from kvflow.streams.bridge.lifecycle import kafka_bridge_state
from kvflow.streams.bridge.openapi import install_openapi
from kvflow.streams.bridge.routes import chat, completions, embeddings, health, images, models, responses
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.catalog import Catalog

__all__ = ["build_app", "build_app_for_state"]


def _assemble(lifespan: Callable[[FastAPI], Any] | None) -> FastAPI:
    app = FastAPI(title="kvflow bridge", summary="OpenAI-compatible HTTP front of a kvflow pipeline",
                  lifespan=lifespan)
    install_error_handlers(app)
    for module in (chat, completions, responses, embeddings, images, models, health):
        app.include_router(module.router)
    install_openapi(app)
    return app


def build_app(settings: Settings, catalog: Catalog | None = None, *, slot: int | None = None,
              ensure_topics: bool = True) -> FastAPI:
    """The bridge app; its lifespan connects to Kafka on startup and
    disconnects on shutdown (see :func:`kafka_bridge_state` for ``slot`` and
    ``ensure_topics``). ``catalog`` defaults to ``Catalog(settings.namespace)``.
    ``/v1`` routes require one of the configured API keys (none: open, and
    a warning is logged).

    Raises:
        OSError, ValueError: ``settings.api_keys_file`` cannot be read or
            holds no key (checked here, before any connection).
    """
    catalog = catalog or Catalog(settings.namespace)
    log_auth_mode(configured_api_keys(settings))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with kafka_bridge_state(settings, catalog, slot=slot, ensure_topics=ensure_topics) as state:
            app.state.bridge = state
            try:
                yield
            finally:
                state.attachments.drop_pending()  # streams cut by the shutdown stay resumable elsewhere
                app.state.bridge = None

    return _assemble(lifespan)


def build_app_for_state(state: BridgeState) -> FastAPI:
    """The same routes over an existing :class:`BridgeState`, with no Kafka
    lifespan (the caller owns the state's parts)."""
    log_auth_mode(state.api_keys or frozenset())
    app = _assemble(None)
    app.state.bridge = state
    return app
