"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..context import Context, json_body
from ..formatters import CompletionFormatter
from ..generation import generate_response
from ..prompts import completion_inputs, echoed_prompts
from ..protocol import CompletionRequest, CompletionResponse

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(
    request: Request,
    context: Context,
    req: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
) -> Response:
    context.check_model(req.model)
    prompts, params = completion_inputs(req, context.model, context.options.max_tokens_cap)
    echo = echoed_prompts(req, context.model, prompts) if req.echo else None
    formatter = CompletionFormatter(
        context.model, context.model_name, echo, with_logprobs=req.logprobs is not None
    )
    return await generate_response(
        request,
        context,
        formatter,
        prompts,
        params,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
