"""POST /v1/chat/completions (an API key is required when any is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvflow.schemas import RequestKind
from kvflow.schemas.openai import ChatCompletionResponse
from kvflow.streams.bridge.auth import require_api_key
from kvflow.streams.bridge.openapi import ERROR_RESPONSES
from kvflow.streams.bridge.pipeline import serve
from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["chat"], dependencies=[Depends(require_api_key)],
                   responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: BridgeState = Depends(get_state)) -> Response:
    """OpenAI Chat Completions: a ``chat.completion`` object, or an SSE stream
    of ``chat.completion.chunk`` objects when ``stream`` is true."""
    return await serve(state, request, RequestKind.chat)
