"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.served_model import ServedModel

from .. import paths
from ..context import Context, json_body
from ..formatters import CompletionFormatter
from ..formatters.completions import EchoedPrompt
from ..generation import generate_response
from ..prompts import completion_inputs, echoed_prompts
from ..protocol import CompletionRequest, CompletionResponse

router = APIRouter()


def _inputs(
    req: CompletionRequest, model: ServedModel, cap: int
) -> tuple[list[list[int]], list[SamplingParams], list[EchoedPrompt] | None]:
    prompts, params = completion_inputs(req, model, cap)
    return prompts, params, echoed_prompts(req, model, prompts) if req.echo else None


@router.post(paths.COMPLETIONS, response_model=CompletionResponse)
async def completions(
    request: Request,
    context: Context,
    req: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
) -> Response:
    context.check_model(req.model)
    prompts, params, echo = await context.off_loop(
        _inputs, req, context.model, context.options.max_tokens_cap
    )
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
