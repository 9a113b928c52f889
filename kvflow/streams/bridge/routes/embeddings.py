"""POST /v1/embeddings (an API key is required when any is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvflow.schemas.openai import EmbeddingsResponse
from kvflow.streams.bridge.auth import require_api_key
from kvflow.streams.bridge.embeddings import serve_embeddings
from kvflow.streams.bridge.openapi import ERROR_RESPONSES
from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["embeddings"], dependencies=[Depends(require_api_key)],
                   responses={200: {"model": EmbeddingsResponse}, **ERROR_RESPONSES})


@router.post("/v1/embeddings")
async def embeddings(request: Request, state: BridgeState = Depends(get_state)) -> Response:
    """OpenAI Embeddings: one vector per input (floats or base64), from the
    model's embedding workers."""
    return await serve_embeddings(state, request)
