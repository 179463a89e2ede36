"""POST /v1/embeddings: pooled, L2-normalised final hidden states, one per input."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tallow.runtime.engine import EmbeddingsNotSupportedError
from tallow.runtime.request import ContextLengthExceededError

from .. import paths
from ..context import Context, ServerContext, json_body
from ..errors import APIError, bad_request
from ..formatters import EmbeddingFormatter
from ..formatters.embeddings import render
from ..generation import ClientGone, unless_client_leaves
from ..jobs import check_queue
from ..prompts_embeddings import check_dimensions, embedding_prompts
from ..protocol import EmbeddingRequest, EmbeddingResponse

router = APIRouter()

# An embeddings request keeps this many steps' worth of sequences (x --max-num-seqs) in the
# engine: enough that the next inputs are queued when running ones finish, so a window costs
# no throughput, while requests arriving behind it still get in.
EMBEDDING_WINDOW_STEPS = 2


def _rejection(e: ValueError) -> APIError:
    if isinstance(e, EmbeddingsNotSupportedError):
        return bad_request(str(e), "model", "embeddings_not_supported")
    if isinstance(e, ContextLengthExceededError):
        return bad_request(str(e), "input", ContextLengthExceededError.code)
    return bad_request(str(e), "input")


@router.post(paths.EMBEDDINGS, response_model=EmbeddingResponse)
async def embeddings(
    request: Request,
    context: Context,
    req: Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))],
) -> Response:
    context.check_model(req.model)
    engine = context.engine
    if not engine.supports_embeddings:
        raise _rejection(
            EmbeddingsNotSupportedError(
                f"model {context.model_name!r} cannot embed: its artifact has no hidden-state "
                "function (compiled before embeddings were supported); recompile it"
            )
        )
    prompts = await context.off_loop(_prompts, req, context)
    dimensions = check_dimensions(req.dimensions, engine.embedding_dimensions)
    # Inputs enter the engine a window at a time; the queue counts the window, not the whole
    # request, so a large request does not lock others out (`Engine.embed`).
    window = EMBEDDING_WINDOW_STEPS * engine.max_num_seqs
    held = min(len(prompts), window)
    state, metrics = context.state, context.metrics
    check_queue(state, held, context.options.max_queued_requests)
    formatter = EmbeddingFormatter(context.model_name)
    t0 = time.perf_counter()
    state.queued += held
    metrics.in_flight.inc()
    reason = "abort"
    try:
        vectors = await unless_client_leaves(request, engine.embed(prompts, window))
        reason = "stop"
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the status is for the log
    except ValueError as e:  # raised before anything was queued (checked above already)
        raise _rejection(e) from None
    finally:
        state.queued -= held
        metrics.in_flight.dec()
        metrics.latency.labels(formatter.endpoint).observe(time.perf_counter() - t0)
        metrics.requests.labels(formatter.endpoint, reason).inc()
    for ids in prompts:
        metrics.request_prompt_tokens.observe(len(ids))
    tokens = sum(len(ids) for ids in prompts)
    # 2,048 vectors are megabytes of JSON (or base64): built off the loop, in pieces.
    body = await context.off_loop(
        lambda: render(formatter.response(vectors, tokens, req.encoding_format, dimensions))
    )
    return Response(body, media_type="application/json")


def _prompts(req: EmbeddingRequest, context: ServerContext) -> list[list[int]]:
    prompts = embedding_prompts(req, context.model)
    try:
        for ids in prompts:
            context.engine.check_embedding_prompt(ids)
    except ValueError as e:
        raise _rejection(e) from None
    return prompts
