"""POST /v1/responses (an API key is required when any is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvflow.schemas.openai_responses import ResponseObject
from kvflow.streams.bridge.auth import require_api_key
from kvflow.streams.bridge.openapi import ERROR_RESPONSES
from kvflow.streams.bridge.responses_api import serve_responses
from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["responses"], dependencies=[Depends(require_api_key)],
                   responses={200: {"model": ResponseObject}, **ERROR_RESPONSES})


@router.post("/v1/responses")
async def responses(request: Request, state: BridgeState = Depends(get_state)) -> Response:
    """OpenAI Responses: a ``response`` object, or an SSE stream of typed
    ``response.*`` events when ``stream`` is true; ``previous_response_id``
    continues a stored conversation."""
    return await serve_responses(state, request)
