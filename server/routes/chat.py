"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from .. import paths
from ..context import Context, json_body
from ..formatters import ChatFormatter
from ..generation import generate_response
from ..prompts import chat_inputs
from ..protocol_chat import ChatCompletionRequest, ChatCompletionResponse

router = APIRouter()


@router.post(paths.CHAT_COMPLETIONS, response_model=ChatCompletionResponse)
async def chat_completions(
    request: Request,
    context: Context,
    req: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))],
) -> Response:
    context.check_model(req.model)
    prompts, params, output = await context.off_loop(
        chat_inputs, req, context.model, context.options.max_tokens_cap
    )
    return await generate_response(
        request,
        context,
        ChatFormatter(context.model, context.model_name, output),
        prompts,
        params,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
