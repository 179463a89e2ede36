"""Per-app state and the FastAPI dependencies that hand it to the routes.

`create_app` builds one `ServerContext` and stores it on `app.state`; routes receive it
through `Context` (a dependency), never through closures, so each route module stands alone
and several apps can live in one process. Request bodies are read and validated by `json_body`
dependencies: with a size limit (also for chunked bodies), strict JSON, and OpenAI-shaped
errors naming the offending field.

Two rules make every request's text safe before any route sees it. A body is read only when it
says `Content-Type: application/json` (415 otherwise): a web page can make a browser send a
cross-origin `text/plain` POST without asking the server first, never an `application/json`
one. And text that is not valid Unicode becomes valid here, in one place for every route: each
lone surrogate that a JSON `\\uXXXX` escape produced, and each byte that is not UTF-8, becomes
U+FFFD (what a UTF-8 decoder makes of broken text), so tokenizers and JSON encoders never meet
a string they cannot encode.
"""

from __future__ import annotations

import json
import math
import re
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
    max_tokens_cap: int = 4096  # chat's max_tokens when a request omits it: room left, capped
    # The Host check (`tallow.server.gate`): the bind address, and names allowed besides the
    # defaults ("*": any); CORS: origins whose pages may call the API ("*": any).
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    ui: bool = True  # the chat page at / (routes/ui.py)


@dataclass
class ServerState:
    """Mutable per-app state; the event loop is its only writer."""

    ready: bool = False
    draining: bool = False
    queued: int = 0  # sequences (prompts x n) of accepted requests without an output yet


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


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(value: Any) -> Any:
    """Parsed JSON with every lone surrogate in its strings (keys too) replaced by U+FFFD.

    `json.loads` joins escaped surrogate pairs into one character, so any surrogate left in a
    string is a lone one."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value
    if isinstance(value, dict):
        return {valid_text(k): valid_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [valid_text(v) for v in value]
    return value


def check_json_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = media or "none"
        raise APIError(
            415,
            f"the body must be JSON sent with Content-Type: application/json (got {shown})",
            code="unsupported_media_type",
        )


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    check_json_content_type(request)
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

    def finite(text: str) -> float:
        value = float(text)
        if math.isinf(value):  # 1e999: JSON, but no number any field can hold
            raise ValueError(f"the number {text[:40]} is out of range")
        return value

    raw = b"".join(chunks)
    strict = {"parse_constant": no_constants, "parse_float": finite}
    try:
        try:
            body = json.loads(raw, **strict)
        except UnicodeDecodeError:  # not UTF-8: repair the text, as for lone surrogates
            body = json.loads(raw.decode("utf-8", "replace"), **strict)
        body = valid_text(body)
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
