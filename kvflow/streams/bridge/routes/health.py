"""GET /health (readiness), /live (liveness) and /metrics (Prometheus); open
to probes and scrapers even when API keys are configured."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvflow.streams.bridge.state import BridgeState, get_state

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(state: BridgeState = Depends(get_state)) -> JSONResponse:
    """Live workers and models; 200 when at least one worker serves and the
    responses reader keeps up, else 503.

    Body: ``{"status": "ok"|"no_workers"|"responses_stalled", "live_workers": n,
    "models": [...], "workers": [{"worker_id", "model", "role", "load"}...],
    "responses_reader": {"ok", "lag", "since_progress_s", "restarts"}}`` (the
    reader entry only when the response source reports its health, as
    :class:`~kvflow.streams.client.KvflowClient` does).
    """
    workers = state.registry.live_workers()
    reader = state.source.health() if hasattr(state.source, "health") else None
    status = "ok" if workers else "no_workers"
    if reader is not None and not reader.ok:
        status = "responses_stalled"
    body = {
        "status": status,
        "live_workers": len(workers),
        "models": sorted({w.model for w in workers}),
        "workers": [{"worker_id": w.worker_id, "model": w.model, "role": w.role.value, "load": w.load}
                    for w in workers],
    }
    if reader is not None:
        body["responses_reader"] = {"ok": reader.ok, "lag": reader.lag,
                                    "since_progress_s": round(reader.since_progress_s, 3), "restarts": reader.restarts}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/live")
async def live() -> dict[str, str]:
    """Always 200 while the process serves HTTP."""
    return {"status": "live"}


@router.get("/metrics")
async def metrics(state: BridgeState = Depends(get_state)) -> Response:
    """The bridge's Prometheus series in the text exposition format."""
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
