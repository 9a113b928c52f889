"""A request's serving class at the bridge: priority, tenant and session.

* **priority** (higher is served first by the router's ``priority`` queue
  order): the body's ``priority`` field when sent, else the
  :data:`PRIORITY_HEADER` header, else 0;
* **tenant**: a digest of the bearer API key (:func:`tenant_of`), so the
  router can share its queue fairly among keys; the key itself never goes
  on a topic. None without a key;
* **session**: the body's ``session_id`` extension field, else the
  :data:`SESSION_HEADER` header; requests of one session prefer one worker.

Pure functions of the headers and the parsed body; no I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from starlette.datastructures import Headers

from kvflow.schemas.openai import INT32_MAX, INT32_MIN
from kvflow.streams.bridge.errors import invalid_request

__all__ = ["PRIORITY_HEADER", "SESSION_HEADER", "MAX_SESSION_ID_CHARS", "ServingClass", "serving_class",
           "tenant_of"]

PRIORITY_HEADER = "X-Priority"
"""Request header: the priority class, an integer (higher first); the body's ``priority`` wins."""

SESSION_HEADER = "X-Session-Id"
"""Request header: the session id; the body's ``session_id`` wins."""

MAX_SESSION_ID_CHARS = 256
"""Longest session id accepted (characters)."""


@dataclass(frozen=True)
class ServingClass:
    """What the router orders and places a request by (module docstring)."""

    priority: int = 0
    tenant: str | None = None
    session_id: str | None = None


def tenant_of(api_key: str) -> str:
    """The tenant id of ``api_key``: ``t-`` and the first 16 hex digits of its
    SHA-256 (64 bits: distinct for any realistic number of keys, and not the key)."""
    return "t-" + hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _bearer(headers: Headers) -> str | None:
    scheme, _, key = headers.get("Authorization", "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def serving_class(headers: Headers, body_priority: int | None, body_session_id: str | None) -> ServingClass:
    """The serving class of a request (module docstring).

    Args:
        headers: the HTTP request's headers.
        body_priority: the body's ``priority`` when the client sent it, else None.
        body_session_id: the body's ``session_id``, else None.

    Raises:
        BridgeError: 400 when :data:`PRIORITY_HEADER` is not a 32-bit integer
            or :data:`SESSION_HEADER` is empty or longer than :data:`MAX_SESSION_ID_CHARS`.
    """
    priority = body_priority
    if priority is None:
        raw = headers.get(PRIORITY_HEADER)
        priority = 0
        if raw is not None:
            try:
                priority = int(raw.strip())
            except ValueError:
                priority = INT32_MAX + 1
            if not INT32_MIN <= priority <= INT32_MAX:
                raise invalid_request(f"{PRIORITY_HEADER} must be an integer in [{INT32_MIN}, {INT32_MAX}], "
                                      f"not {raw!r}.", param=PRIORITY_HEADER, code="invalid_value")
    session = body_session_id
    if session is None:
        raw = headers.get(SESSION_HEADER)
        if raw is not None:
            if not 0 < len(raw) <= MAX_SESSION_ID_CHARS:
                raise invalid_request(f"{SESSION_HEADER} must have 1 to {MAX_SESSION_ID_CHARS} characters.",
                                      param=SESSION_HEADER, code="invalid_value")
            session = raw
    key = _bearer(headers)
    return ServingClass(priority, tenant_of(key) if key is not None else None, session)
