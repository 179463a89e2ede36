"""The FastAPI app: routes, authentication, body limits, draining, and the uvicorn launcher.

Only `tallow.runtime` is imported: the server runs where the compiler (and relax) is absent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, bad_request, from_validation_error, install_handlers
from .metrics import ServerMetrics
from .prompts import ModelInfo, chat_inputs, completion_inputs
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .serving import Job, ServerState, collect, stream

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    api_key: str | None = None
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 30.0
    max_tokens_cap: int = 4096  # default max_tokens when a request omits it


class _Gate:
    """Pure ASGI middleware (so streaming and disconnects pass through untouched): API key
    on every route but /health, and 503 for new requests while draining."""

    def __init__(self, app: ASGIApp, options: ServerOptions, state: ServerState) -> None:
        self.app, self.options, self.state = app, options, state
        key = options.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        if self._expected is not None:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):
                err = APIError(
                    401,
                    "missing or incorrect API key (send Authorization: Bearer <key>)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                return await err.response()(scope, receive, send)
        if self.state.draining:
            err = APIError(
                503, "the server is shutting down", type="server_error", code="shutting_down"
            )
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class _SSEResponse(StreamingResponse):
    """Closes the job however the response ends; a never-started generator has no finally."""

    def __init__(self, content: Any, job: Job) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.job.close()


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies carry no Content-Length
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(b"".join(chunks), parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_request")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(engine: Any, model_name: str, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    state = ServerState()
    metrics = ServerMetrics(engine.stats)
    info = ModelInfo.from_engine(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            state.draining = True
            await engine.shutdown()

    app = FastAPI(title="tallow", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tallow = state
    app.state.metrics = metrics
    install_handlers(app)
    app.add_middleware(_Gate, options=options, state=state)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server has {model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def run(request: Request, kind: str) -> Response:
        body = await _read_json(request, options.max_body_bytes)
        if kind == "chat":
            req = _parse(ChatCompletionRequest, body)
            check_model(req.model)
            prompts, params = chat_inputs(req, info, options.max_tokens_cap)
        else:
            req = _parse(CompletionRequest, body)
            check_model(req.model)
            prompts, params = completion_inputs(req, info, options.max_tokens_cap)
        job = Job(engine, state, metrics, kind, prompts, params, options.max_queued_requests)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(stream(job, info, model_name, usage, len(prompts)), job)
        # Non-streaming: watch for the client leaving while the job runs, and abort it then.
        work = asyncio.ensure_future(collect(job, info, model_name))
        gone = asyncio.ensure_future(_until_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                job.close()
        if work not in done:
            return Response(status_code=499)  # nobody reads it; the status is for the log
        return JSONResponse(work.result())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, "completion")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tallow",
            "max_model_len": info.context_window,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = _parse(TokenizeRequest, await _read_json(request, options.max_body_bytes))
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = info.encode_chat(req.messages)
        else:
            ids = info.encode_text(req.prompt or "", req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": info.context_window}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = _parse(DetokenizeRequest, await _read_json(request, options.max_body_bytes))
        check_model(req.model)
        info.check_token_ids(req.tokens, "tokens")
        return {"prompt": info.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health() -> Response:
        if not state.ready or state.draining:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.queued.set(state.queued)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
