"""POST /v1/embeddings: pooled, L2-normalised final hidden states, one per input."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from tallow.runtime.engine import EmbeddingsNotSupportedError
from tallow.runtime.request import ContextLengthExceededError

from ..context import Context, json_body
from ..errors import APIError, bad_request
from ..formatters import EmbeddingFormatter
from ..jobs import check_queue
from ..prompts_embeddings import check_dimensions, embedding_prompts
from ..protocol import EmbeddingRequest, EmbeddingResponse

router = APIRouter()


def _rejection(e: ValueError) -> APIError:
    if isinstance(e, EmbeddingsNotSupportedError):
        return bad_request(str(e), "model", "embeddings_not_supported")
    if isinstance(e, ContextLengthExceededError):
        return bad_request(str(e), "input", ContextLengthExceededError.code)
    return bad_request(str(e), "input")


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def embeddings(
    context: Context,
    req: Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))],
) -> JSONResponse:
    context.check_model(req.model)
    engine = context.engine
    if not engine.supports_embeddings:
        raise _rejection(
            EmbeddingsNotSupportedError(
                f"model {context.model_name!r} cannot embed: its artifact has no hidden-state "
                "function (compiled before embeddings were supported); recompile it"
            )
        )
    prompts = embedding_prompts(req, context.model)
    dimensions = check_dimensions(req.dimensions, engine.embedding_dimensions)
    try:
        for ids in prompts:
            engine.check_embedding_prompt(ids)
    except ValueError as e:
        raise _rejection(e) from None
    state, metrics = context.state, context.metrics
    check_queue(state, len(prompts), context.options.max_queued_requests)
    formatter = EmbeddingFormatter(context.model_name)
    t0 = time.perf_counter()
    state.queued += len(prompts)
    metrics.in_flight.inc()
    reason = "abort"
    try:
        vectors = await engine.embed(prompts)
        reason = "stop"
    except ValueError as e:  # raised before anything was queued (checked above already)
        raise _rejection(e) from None
    finally:
        state.queued -= len(prompts)
        metrics.in_flight.dec()
        metrics.latency.labels(formatter.endpoint).observe(time.perf_counter() - t0)
        metrics.requests.labels(formatter.endpoint, reason).inc()
    for ids in prompts:
        metrics.request_prompt_tokens.observe(len(ids))
    tokens = sum(len(ids) for ids in prompts)
    body = formatter.response(vectors, tokens, req.encoding_format, dimensions)
    return JSONResponse(body.model_dump())
