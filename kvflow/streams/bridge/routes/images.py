"""POST /v1/images/generations (an API key is required when any is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvflow.schemas.openai_images import ImagesResponse
from kvflow.streams.bridge.auth import require_api_key
from kvflow.streams.bridge.images import serve_images
from kvflow.streams.bridge.openapi import ERROR_RESPONSES
from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["images"], dependencies=[Depends(require_api_key)],
                   responses={200: {"model": ImagesResponse}, **ERROR_RESPONSES})


@router.post("/v1/images/generations")
async def generations(request: Request, state: BridgeState = Depends(get_state)) -> Response:
    """OpenAI Images: ``n`` base64 PNG images of the prompt, from the model's
    text-stage and image-stage workers."""
    return await serve_images(state, request)
