"""Running the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

On a signal the app's draining flag is set: new requests get 503 (`shutting_down`) and
/health answers 503, while the listener stays open so that clients get that answer instead
of a refused connection. In-flight requests get up to `--shutdown-timeout` seconds to finish.
If some are still running then, they end with an error (an SSE `data:` event in OpenAI's
error shape, then `data: [DONE]`, for a stream; a 503 otherwise) and the process exits with
status 1; a drain that completes exits 0. Only then does uvicorn close the listener and the
connections.

Connections. uvicorn closes idle keep-alive connections after `timeout_keep_alive`, but a
connection that has sent part of a request (headers or body) is never timed out by it, so a
slow or stalled client could hold a connection forever. `GuardedH11Protocol` gives every
request `request_timeout` seconds from the moment the connection is ready for it until its
last body byte; past that the connection is closed (the app, if it was reading the body,
sees a disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import ServerOptions, create_app
from .errors import APIError

log = logging.getLogger(__name__)

# What is left after the drain: time for the final error events to reach their clients.
_FLUSH_TIMEOUT_S = 3


class GuardedH11Protocol(H11Protocol):
    """h11, with a deadline for receiving each whole request (headers and body)."""

    request_timeout: float = 30.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard: asyncio.TimerHandle | None = None
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request on this connection (maybe pipelined) gets a deadline
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_guard", None) is not None:
            self._guard.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
        self._armed_cycle = self.cycle  # a request arriving from now on replaces it
        self._guard = self.loop.call_later(self.request_timeout, self._expire)

    def _expire(self) -> None:
        self._guard = None
        cycle = self.cycle
        new = cycle is not None and cycle is not self._armed_cycle
        if new and (not cycle.more_body or cycle.response_started):
            return  # the request arrived whole: the app takes it from here
        if self.transport.is_closing():
            return
        what = "its body" if new else "a request"
        log.info(
            "closing a connection from %s that did not send %s within %.0fs",
            (self.client or ("?",))[0],
            what,
            self.request_timeout,
        )
        self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.tallow_state = app.state.tallow
        self.tallow_engine = app.state.context.engine
        self.shutdown_timeout = shutdown_timeout
        self.drain_timed_out = False
        self.announce: Callable[[int], None] | None = None  # told the port once listening

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.announce is not None:
            self.announce(self.bound_port)

    @property
    def bound_port(self) -> int:
        """The port the listener got (the one asked for, or the kernel's pick for port 0)."""
        return int(self.servers[0].sockets[0].getsockname()[1])

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.tallow_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after shutting down, so the process dies
        # "by SIGTERM"; the exit status is ours to choose (see `serve`).
        with super().capture_signals():
            yield
            if hasattr(self, "_captured_signals"):
                self._captured_signals.clear()

    async def shutdown(self, sockets: Any = None) -> None:
        self.tallow_state.draining = True
        await self._drain()
        await super().shutdown(sockets)  # closes the listener, then the connections

    def _busy(self) -> int:
        return len(self.server_state.tasks)

    async def _drain(self) -> None:
        """Wait for in-flight requests while the listener stays open (the gate answers 503);
        past the timeout, end them with an error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        if self._busy():
            log.warning("draining %d request(s), up to %.0fs", self._busy(), self.shutdown_timeout)
        while self._busy() and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if not self._busy():
            return
        self.drain_timed_out = True
        log.error(
            "shutdown timeout (%.0fs) passed with %d request(s) running; ending them with an error",
            self.shutdown_timeout,
            self._busy(),
        )
        error = APIError(
            503,
            "the server shut down before this request finished",
            type="server_error",
            code="shutting_down",
        )
        with contextlib.suppress(AttributeError):  # an engine stand-in without the method
            self.tallow_engine.fail_all_requests(error)


def make_server(app: FastAPI, host: str, port: int, options: ServerOptions) -> DrainingServer:
    protocol = type(
        "GuardedH11Protocol", (GuardedH11Protocol,), {"request_timeout": options.request_timeout}
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=_FLUSH_TIMEOUT_S,
        log_level="warning",
        lifespan="on",
    )
    return DrainingServer(config, app, options.shutdown_timeout)


def serve(
    engine: Any,
    model_name: str,
    options: ServerOptions,
    host: str,
    port: int,
    listener: socket.socket | None = None,
) -> int:
    """Serve until a signal; the exit status: 0 after a complete drain, 1 when requests had
    to be cut off at the shutdown timeout. Once listening it prints `serving NAME on URL` to
    stderr, with the port it got (port 0: a free one the kernel picks). `listener`: the
    socket `bind_listener` bound for `host`:`port` (else uvicorn binds it)."""
    options = dataclasses.replace(options, host=host)  # the Host check allows the bind address
    app = create_app(engine, model_name, options)
    server = make_server(app, host, port, options)

    def announce(bound: int) -> None:
        print(f"serving {model_name} on http://{host}:{bound}", file=sys.stderr, flush=True)

    server.announce = announce
    server.run(sockets=[listener] if listener is not None else None)
    return 1 if server.drain_timed_out else 0
