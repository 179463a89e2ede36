"""GET /health, /health/live, /health/ready (no API key: load balancers and Kubernetes probe
them) and GET /metrics (Prometheus).

/health and /health/ready say the same (ready: loaded and not draining); /health stays for
the clients that probe it today. /health/live only says the process answers: a liveness probe
that failed while loading or draining would make Kubernetes kill a pod that is doing its job.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .. import paths
from ..context import Context
from ..protocol import HealthResponse

router = APIRouter()


def _readiness(context: Context) -> JSONResponse:
    state = context.state
    if not state.ready or state.draining:
        return JSONResponse(HealthResponse(status="unavailable").model_dump(), status_code=503)
    return JSONResponse(HealthResponse(status="ok").model_dump())


@router.get(paths.HEALTH, response_model=HealthResponse)
async def health(context: Context) -> JSONResponse:
    return _readiness(context)


@router.get(paths.HEALTH_READY, response_model=HealthResponse)
async def health_ready(context: Context) -> JSONResponse:
    return _readiness(context)


@router.get(paths.HEALTH_LIVE, response_model=HealthResponse)
async def health_live() -> JSONResponse:
    return JSONResponse(HealthResponse(status="ok").model_dump())


@router.get(paths.METRICS, response_class=PlainTextResponse)
async def metrics(context: Context) -> Response:
    context.metrics.queued.set(context.state.queued)
    body = context.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
