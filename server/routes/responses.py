"""POST /v1/responses: OpenAI's Responses API over the chat path (nothing is stored)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from .. import paths
from ..context import Context, json_body
from ..errors import APIError
from ..formatters import ResponsesFormatter
from ..generation import generate_response
from ..prompts_responses import echoed_settings, responses_inputs, responses_param
from ..protocol_responses import ResponseCreateRequest, ResponseObject

router = APIRouter()


@router.post(paths.RESPONSES, response_model=ResponseObject)
async def responses(
    request: Request,
    context: Context,
    req: Annotated[ResponseCreateRequest, Depends(json_body(ResponseCreateRequest))],
) -> Response:
    context.check_model(req.model)
    prompts, params, output = await context.off_loop(
        responses_inputs, req, context.model, context.options.max_tokens_cap
    )
    settings = echoed_settings(req, context.model)
    formatter = ResponsesFormatter(context.model, context.model_name, output, settings)
    try:
        return await generate_response(
            request, context, formatter, prompts, params, stream=req.stream, include_usage=True
        )
    except APIError as e:  # the engine's rejections name chat parameters
        raise responses_param(e) from None
