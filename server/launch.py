"""Running the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

uvicorn already stops accepting connections on a signal and waits up to
`timeout_graceful_shutdown` for in-flight requests; we add the app's draining flag so new
requests on connections still open get 503 (and /health fails) instead of being served.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from .app import ServerOptions, create_app
from .context import ServerState


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.tallow_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.tallow_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after shutting down, so the process dies
        # "by SIGTERM"; a completed drain is a clean exit, status 0.
        with super().capture_signals():
            yield
            if hasattr(self, "_captured_signals"):
                self._captured_signals.clear()


def make_server(app: FastAPI, host: str, port: int, options: ServerOptions) -> DrainingServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=max(1, int(options.shutdown_timeout + 0.999)),
        log_level="warning",
        lifespan="on",
    )
    return DrainingServer(config, app.state.tallow)


def serve(engine: Any, model_name: str, options: ServerOptions, host: str, port: int) -> None:
    options = dataclasses.replace(options, host=host)  # the Host check allows the bind address
    app = create_app(engine, model_name, options)
    make_server(app, host, port, options).run()
