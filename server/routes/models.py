"""GET /v1/models: the one model this server has."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from .. import paths
from ..context import Context
from ..protocol import ModelCard, ModelList

router = APIRouter()


@router.get(paths.MODELS, response_model=ModelList)
async def list_models(context: Context) -> JSONResponse:
    card = ModelCard(
        id=context.model_name,
        created=int(time.time()),
        max_model_len=context.model.context_window,
    )
    return JSONResponse(ModelList(data=[card]).model_dump())
