"""Reading a request body with a size limit."""

from __future__ import annotations

from fastapi import Request

from kvflow.streams.bridge.errors import invalid_request, payload_too_large

__all__ = ["read_body"]


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The raw body of ``request``, at most ``limit_bytes`` long.

    The declared ``Content-Length`` is checked first; a chunked body is
    counted as it arrives and reading stops at the limit, so an oversized
    body is never buffered whole.

    Raises:
        BridgeError: 413 over the limit; 400 for a malformed Content-Length.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise invalid_request("Malformed Content-Length header.") from None
        if size > limit_bytes:
            raise payload_too_large(f"Request body of {size} bytes exceeds the limit of {limit_bytes} bytes.")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit_bytes:
            raise payload_too_large(f"Request body exceeds the limit of {limit_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)
