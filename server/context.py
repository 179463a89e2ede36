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

Nothing that costs in proportion to what a client sends runs on the event loop: parsing and
validating a body, templating, tokenizing, compiling a grammar and rendering a large answer go
to `ServerContext.off_loop`'s threads (issue 33: a 60,000-option `guided_choice` held `/health`
for 6-11 s and paused a running stream for 14 s; a 3.6 MB prompt stalled the loop for 5 s). The
loop only moves bytes. A body nested deeper than `MAX_JSON_DEPTH` is refused before anything
walks it: every layer above (pydantic, the chat template, llguidance) recurses through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from tallow.runtime.sampling_defaults import SamplingDefaults
from tallow.runtime.served_model import ServedModel

from .errors import APIError, bad_request, from_validation_error
from .metrics import ServerMetrics

Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")

# The deepest a request body may nest (objects and arrays). JSON schemas and tool parameters
# of real use nest a few dozen levels; 475 levels reached Python's recursion limit in the chat
# template's string walk (a 500, issue 33), and each layer below recurses through the body.
MAX_JSON_DEPTH = 128

# Threads for request preparation (`ServerContext.off_loop`). Four: a heavy request (a 4 MB
# prompt to tokenize, a large grammar) does not make every other one wait behind it, and
# the engine's own step thread is never among them.
PREPARE_THREADS = 4


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
    # Defaults for the sampling fields a request leaves unset, in place of the model's own
    # (`tallow serve --sampling-defaults`, `--temperature`, ...); None: the model's.
    sampling_defaults: SamplingDefaults | None = None
    # The Ray Serve replica this app runs in (`server/ray_app.py`): a label on its metrics.
    replica: str | None = None


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
    workers: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            PREPARE_THREADS, thread_name_prefix="tallow-prepare"
        )
    )

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a preparation thread, so the event loop stays free. If
        the request is cancelled (client gone), the call still runs to its end, unread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.workers, functools.partial(fn, *args, **kwargs))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


async def get_context(request: Request) -> ServerContext:
    """Async on purpose: FastAPI runs a plain `def` dependency on anyio's worker threads
    (up to 40, started lazily and retired after 10 s idle), one thread hop per request for an
    attribute read; under 64 soak clients that pool grew the server by 9 threads."""
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


async def read_json(request: Request, limit: int) -> bytes:
    """The raw body, refused past `limit` bytes (chunked bodies too) or when not JSON."""
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
    return b"".join(chunks)


def _too_deep() -> APIError:
    return bad_request(
        f"the body nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
        code="nesting_too_deep",
    )


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` has objects/arrays more than `limit` levels deep (no recursion:
    it is what keeps recursion away from the rest)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json(raw: bytes) -> dict[str, Any]:
    """A body as a JSON object: strict (no NaN, no infinite numbers), at most `MAX_JSON_DEPTH`
    deep, its text valid Unicode. A blocking call: run it off the loop."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    def finite(text: str) -> float:
        value = float(text)
        if math.isinf(value):  # 1e999: JSON, but no number any field can hold
            raise ValueError(f"the number {text[:40]} is out of range")
        return value

    strict = {"parse_constant": no_constants, "parse_float": finite}
    try:
        try:
            body = json.loads(raw, **strict)
        except UnicodeDecodeError:  # not UTF-8: repair the text, as for lone surrogates
            body = json.loads(raw.decode("utf-8", "replace"), **strict)
    except RecursionError:  # deeper than the parser goes: far past the limit
        raise _too_deep() from None
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_request")
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return valid_text(body)


def json_body(model: type[Body]) -> Callable[[Request, ServerContext], Awaitable[Body]]:
    """A dependency that reads the request body and validates it as `model`.

    FastAPI's own body parsing is not used: it would coerce types (strict mode is wanted),
    accept NaN, and answer 422 in its own shape instead of OpenAI's.
    """

    async def parse(request: Request, context: Context) -> Body:
        raw = await read_json(request, context.options.max_body_bytes)
        return await context.off_loop(_validated, model, raw)

    return parse


def _validated(model: type[Body], raw: bytes) -> Body:
    try:
        return model.model_validate(parse_json(raw))
    except ValidationError as e:
        raise from_validation_error(e) from None
