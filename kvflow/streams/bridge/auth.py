"""Bearer-key authentication of the bridge's OpenAI routes.

``/v1/*`` routes depend on :func:`require_api_key`; ``/health``, ``/live``
and ``/metrics`` stay open for probes and scrapers. A request without a
valid ``Authorization: Bearer <key>`` gets 401 ``invalid_api_key`` with an
OpenAI error body, unless no key is configured (then every request passes).
"""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvflow.streams.bridge.api_keys import key_matches
from kvflow.streams.bridge.errors import invalid_api_key
from kvflow.streams.bridge.state import get_state

__all__ = ["bearer", "require_api_key"]

bearer = HTTPBearer(auto_error=False, description="An API key of this deployment (KVFLOW_API_KEYS).")
"""The security scheme (documented in the OpenAPI schema); reads the header only."""


async def require_api_key(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    """FastAPI dependency: pass a request carrying a configured key.

    Raises:
        BridgeError: 401 ``invalid_api_key`` when keys are configured and
            the request has no bearer key or an unknown one.
    """
    keys = get_state(request).api_keys
    if not keys:
        return
    if credentials is None:
        raise invalid_api_key("Missing API key: send `Authorization: Bearer <key>`.")
    if not key_matches(credentials.credentials, keys):
        raise invalid_api_key("Incorrect API key provided.")
