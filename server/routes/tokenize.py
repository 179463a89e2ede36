"""POST /tokenize and /detokenize: the server's own tokenizer, for clients that count tokens
or check what a chat template makes of their messages (vLLM's extension of the API)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from tallow.runtime.served_model import ServedModel

from .. import paths
from ..context import Context, json_body
from ..errors import bad_request
from ..prompts import check_token_ids, encode_messages
from ..protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

router = APIRouter()


@router.post(paths.TOKENIZE, response_model=TokenizeResponse)
async def tokenize(
    context: Context,
    req: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))],
) -> JSONResponse:
    context.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    return await context.off_loop(_tokenize, req, context.model)


def _tokenize(req: TokenizeRequest, model: ServedModel) -> JSONResponse:
    # Unbounded by the context window (clients count tokens to decide what to cut), so up
    # to the body limit: seconds of work for megabytes of text, all of it off the loop.
    if req.messages is not None:
        ids = encode_messages(model, req.messages)
    else:
        ids = model.encode_text(req.prompt or "", req.add_special_tokens)
    body = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=model.context_window)
    return JSONResponse(body.model_dump())


@router.post(paths.DETOKENIZE, response_model=DetokenizeResponse)
async def detokenize(
    context: Context,
    req: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))],
) -> JSONResponse:
    context.check_model(req.model)
    return await context.off_loop(_detokenize, req, context.model)


def _detokenize(req: DetokenizeRequest, model: ServedModel) -> JSONResponse:
    check_token_ids(model, req.tokens, "tokens")
    return JSONResponse(DetokenizeResponse(prompt=model.decode(req.tokens)).model_dump())
