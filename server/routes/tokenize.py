"""POST /tokenize and /detokenize: the server's own tokenizer, for clients that count tokens
or check what a chat template makes of their messages (vLLM's extension of the API)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from ..context import Context, json_body
from ..errors import bad_request
from ..prompts import check_token_ids, encode_messages
from ..protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(
    context: Context,
    req: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))],
) -> JSONResponse:
    context.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        ids = encode_messages(context.model, req.messages)
    else:
        ids = context.model.encode_text(req.prompt or "", req.add_special_tokens)
    body = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=context.model.context_window)
    return JSONResponse(body.model_dump())


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(
    context: Context,
    req: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))],
) -> JSONResponse:
    context.check_model(req.model)
    check_token_ids(context.model, req.tokens, "tokens")
    return JSONResponse(DetokenizeResponse(prompt=context.model.decode(req.tokens)).model_dump())
