"""GET /v1/models and /v1/models/{model}: models served by live workers
(an API key is required when any is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from kvflow.schemas.openai import ModelCard, ModelList
from kvflow.streams.bridge.auth import require_api_key
from kvflow.streams.bridge.errors import model_not_found
from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["models"], dependencies=[Depends(require_api_key)])


def _card(state: BridgeState, model: str) -> ModelCard:
    return ModelCard(id=model, created=state.registry.models_seen.get(model, 0))


@router.get("/v1/models")
async def list_models(state: BridgeState = Depends(get_state)) -> Response:
    """OpenAI list of models with at least one live serving worker."""
    body = ModelList(data=[_card(state, m) for m in state.registry.models()])
    return Response(body.model_dump_json(), media_type="application/json")


@router.get("/v1/models/{model:path}")
async def get_model(model: str, state: BridgeState = Depends(get_state)) -> Response:
    """One model card; 404 ``model_not_found`` if no live worker serves it."""
    if model not in state.registry.models():
        raise model_not_found(model)
    return Response(_card(state, model).model_dump_json(), media_type="application/json")
