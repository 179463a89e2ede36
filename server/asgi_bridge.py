"""tallow's own ASGI app, driven without a socket: one request in, its response out as a
stream of parts; and the app's lifespan, started and stopped by hand.

Under Ray Serve (`ray_app.py`) the HTTP request reaches an engine replica as a Python object
through a deployment handle, never as bytes on a socket, yet every promise of the single
server (errors in OpenAI's shape, SSE, the API key, body limits, 429, aborting on a client's
disconnect) lives in that app. Driving the unchanged app in-process keeps one implementation
of all of them instead of a second copy for Serve.

Standard library and Starlette's types only: no Ray here, so the fast tests exercise it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message


@dataclass
class Forwarded:
    """One HTTP request as the ingress hands it to an engine replica (picklable).

    `prompt` is the text Ray's prefix-cache-affinity router matches on (it reads an argument's
    `prompt` attribute): the request's messages or prompt, "" where there is none."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    prompt: str = ""
    client: tuple[str, int] | None = None


@dataclass
class ResponseStart:
    """The first part of every answer: its status and headers; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def call(
    app: ASGIApp, request: Forwarded, extra_headers: list[tuple[bytes, bytes]] = ()
) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through `app`: a `ResponseStart`, then the body's chunks as the app sends
    them. If the consumer stops early (its client left; the generator is closed or cancelled),
    the app receives `http.disconnect`, which is how tallow's routes learn to abort the
    sequence and free its pages."""
    scope = {
        "type": "http",
        # 2.3: Starlette then listens for http.disconnect while it streams (2.4 would wait for
        # a failed send, which never comes here).
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": list(request.headers),
        "client": request.client,
        "server": None,
    }
    parts: asyncio.Queue[ResponseStart | bytes | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), *extra_headers]
            await parts.put(ResponseStart(message["status"], headers))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await parts.put(bytes(message["body"]))
            if not message.get("more_body", False):
                await parts.put(None)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await parts.put(None)  # an app that raised still ends the stream

    task = asyncio.create_task(run())
    try:
        while (part := await parts.get()) is not None:
            yield part
        await task
    finally:
        # The consumer left (or the app finished): tell the app, and let it wind down on its
        # own, so its abort runs even though nobody waits for it here.
        gone.set()
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error was already answered by the app


class Lifespan:
    """The app's ASGI lifespan (what uvicorn runs): `startup` starts the engine, `shutdown`
    drains it."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _send(self, message: Message) -> None:
        await self._outbox.put(message)

    async def _exchange(self, kind: str) -> None:
        await self._inbox.put({"type": f"lifespan.{kind}"})
        reply = await self._outbox.get()
        if reply["type"].endswith(".failed"):
            raise RuntimeError(f"lifespan {kind} failed: {reply.get('message', '')}")

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        self._task = asyncio.create_task(self._app(scope, self._inbox.get, self._send))
        await self._exchange("startup")

    @property
    def running(self) -> bool:
        """Started, and its task has not ended (a lifespan that raised has)."""
        return self._task is not None and not self._task.done()

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._exchange("shutdown")
        with contextlib.suppress(Exception):
            await self._task
