"""The OpenAI-compatible HTTP bridge: HTTP requests in, Kafka records out.

:func:`build_app` returns the FastAPI app (serve it with uvicorn).
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "build_app_for_state"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so the tokenize children (``python -m
    # kvflow.streams.bridge.tokenize_worker``) start without FastAPI and the app.
    if name in __all__:
        from kvflow.streams.bridge import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
