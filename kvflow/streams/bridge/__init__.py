"""The OpenAI-compatible HTTP bridge: HTTP requests in, Kafka records out.

:func:`build_app` returns the FastAPI app (serve it with uvicorn).
"""

from kvflow.streams.bridge.app import build_app, build_app_for_state

__all__ = ["build_app", "build_app_for_state"]
