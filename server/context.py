"""Per-app state and the FastAPI dependencies that hand it to the routes.

`create_app` builds one `ServerContext` and stores it on `app.state`; routes receive it
through `Context` (a dependency), never through closures, so each route module stands alone
and several apps can live in one process. Request bodies are read and validated by `json_body`
dependencies: with a size limit (also for chunked bodies), strict JSON, and OpenAI-shaped
errors naming the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from tallow.runtime.served_model import ServedModel

from .errors import APIError, bad_request, from_validation_error
from .metrics import ServerMetrics

Body = TypeVar("Body", bound=BaseModel)


@dataclass
class ServerOptions:
    api_key: str | None = None
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 30.0
    request_timeout: float = 30.0  # seconds to receive a whole request (headers and body)
    max_tokens_cap: int = 4096  # default max_tokens when a request omits it


@dataclass
class ServerState:
    """Mutable per-app state; the event loop is its only writer."""

    ready: bool = False
    draining: bool = False
    queued: int = 0  # accepted requests that have not produced an output yet


@dataclass
class ServerContext:
    """Everything a route needs, one per app."""

    engine: Any  # tallow.runtime.engine.Engine (or a stand-in with the same surface)
    model: ServedModel
    model_name: str  # the name clients use; it may differ from `model.name`
    options: ServerOptions
    state: ServerState
    metrics: ServerMetrics

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


def get_context(request: Request) -> ServerContext:
    return request.app.state.context


Context = Annotated[ServerContext, Depends(get_context)]


async def read_json(request: Request, limit: int) -> dict[str, Any]:
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


def json_body(model: type[Body]) -> Callable[[Request, ServerContext], Awaitable[Body]]:
    """A dependency that reads the request body and validates it as `model`.

    FastAPI's own body parsing is not used: it would coerce types (strict mode is wanted),
    accept NaN, and answer 422 in its own shape instead of OpenAI's.
    """

    async def parse(request: Request, context: Context) -> Body:
        body = await read_json(request, context.options.max_body_bytes)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None

    return parse
