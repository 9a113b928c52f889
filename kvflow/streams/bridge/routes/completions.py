"""POST /v1/completions (an API key is required when any is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvflow.schemas import RequestKind
from kvflow.schemas.openai import CompletionResponse
from kvflow.streams.bridge.auth import require_api_key
from kvflow.streams.bridge.openapi import ERROR_RESPONSES
from kvflow.streams.bridge.pipeline import serve
from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["completions"], dependencies=[Depends(require_api_key)],
                   responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})


@router.post("/v1/completions")
async def completions(request: Request, state: BridgeState = Depends(get_state)) -> Response:
    """OpenAI (legacy) Completions: a ``text_completion`` object, or an SSE
    stream of ``text_completion`` chunks when ``stream`` is true."""
    return await serve(state, request, RequestKind.completion)
