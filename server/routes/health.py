"""GET /health (no API key: load balancers probe it) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .. import paths
from ..context import Context
from ..protocol import HealthResponse

router = APIRouter()


@router.get(paths.HEALTH, response_model=HealthResponse)
async def health(context: Context) -> JSONResponse:
    state = context.state
    if not state.ready or state.draining:
        return JSONResponse(HealthResponse(status="unavailable").model_dump(), status_code=503)
    return JSONResponse(HealthResponse(status="ok").model_dump())


@router.get(paths.METRICS, response_class=PlainTextResponse)
async def metrics(context: Context) -> Response:
    context.metrics.queued.set(context.state.queued)
    body = context.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
