"""Request deadlines: the bound within which every request gets its one terminal answer.

A request's deadline (``InferenceRequest.deadline_ms``, epoch ms) is its
arrival time plus a timeout. The caller may set the timeout (the bridge's
``timeout_s`` body field or ``X-Request-Timeout`` header); otherwise it is
``Settings.request_deadline_s`` when set, else derived from the output cap::

    timeout_s = deadline_ttft_s + max_tokens × deadline_per_token_ms / 1000

``deadline_ttft_s`` (120 s) allows for queueing, routing and a long prefill
before the first token, ``deadline_per_token_ms`` (200 ms) for each output
token (four times the default 50 ms ITL target). With the defaults a
256-token request gets 171.2 s and a 32768-token one 6673.6 s.

Who enforces it: the worker ends a request it holds at its deadline (engine
abort, final response with error ``deadline_exceeded``), the router's
shedding queue answers a request still held at its deadline, and the
Kafka-native client (so the bridge too) stops waiting at the deadline,
answers the same error and publishes a cancel, so a request that never
reached a worker, or whose worker stalled, still ends on time.
"""

from __future__ import annotations

from kvflow.schemas.requests import MAX_TIMEOUT_S
from kvflow.settings import Settings

__all__ = ["MAX_TIMEOUT_S", "default_timeout_s", "request_timeout_s", "deadline_ms"]


def default_timeout_s(settings: Settings, max_tokens: int) -> float:
    """Seconds a request of ``max_tokens`` output tokens gets when its caller sets none:
    ``settings.request_deadline_s``, else ``deadline_ttft_s + max_tokens ×
    deadline_per_token_ms / 1000`` (see the module doc), capped at :data:`MAX_TIMEOUT_S`."""
    if settings.request_deadline_s is not None:
        return settings.request_deadline_s
    return min(MAX_TIMEOUT_S, settings.deadline_ttft_s + max_tokens * settings.deadline_per_token_ms / 1000)


def request_timeout_s(settings: Settings, max_tokens: int, *requested: float | None) -> float:
    """The timeout of one request: the smallest of the ``requested`` timeouts
    given (seconds; None entries ignored), else :func:`default_timeout_s`.

    Raises:
        ValueError: a requested timeout is not in (0, :data:`MAX_TIMEOUT_S`].
    """
    given = [t for t in requested if t is not None]
    for t in given:
        if not 0 < t <= MAX_TIMEOUT_S:
            raise ValueError(f"a request timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, not {t:g}")
    return min(given) if given else default_timeout_s(settings, max_tokens)


def deadline_ms(created_ms: int, timeout_s: float) -> int:
    """The absolute deadline (epoch ms) of a request created at ``created_ms`` with ``timeout_s``."""
    return created_ms + round(timeout_s * 1000)
