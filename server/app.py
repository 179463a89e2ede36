"""The FastAPI app, assembled: the gate (API key, draining), the lifespan that runs the engine,
OpenAI-shaped error handlers, the routers of `tallow.server.routes` (the chat page's
only while `ServerOptions.ui` is on), and the OpenAPI document (`openapi.py`).

Only `tallow.runtime` is imported: the server runs where the compiler (and relax) is absent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from .context import ServerContext, ServerOptions, ServerState
from .errors import install_handlers
from .gate import APIGate
from .metrics import ServerMetrics
from .openapi import install_openapi
from .paths import OPENAPI
from .routes import ROUTERS, ui

__all__ = ["ServerOptions", "create_app"]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    context: ServerContext = app.state.context
    context.engine.start()
    context.state.ready = True
    try:
        yield
    finally:
        context.state.ready = False
        context.state.draining = True
        await context.engine.shutdown()
        context.workers.shutdown(wait=False, cancel_futures=True)


def create_app(engine: Any, model_name: str, options: ServerOptions | None = None) -> FastAPI:
    """An app serving `engine`'s model as `model_name`; uvicorn runs it (see `launch`)."""
    options = options or ServerOptions()
    model = engine.model
    if options.sampling_defaults is not None:
        model = dataclasses.replace(model, sampling_defaults=options.sampling_defaults)
    context = ServerContext(
        engine=engine,
        model=model,
        model_name=model_name,
        options=options,
        state=ServerState(),
        metrics=ServerMetrics(engine.stats, options.replica),
    )
    app = FastAPI(
        title="tallow", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=OPENAPI
    )
    app.state.context = context
    app.state.tallow = context.state  # the drain flag, for the launcher's signal handler
    install_handlers(app)
    app.add_middleware(APIGate, options=options, state=context.state)
    if options.allowed_origins:
        # Outside the gate (added last), so a browser's preflight, which carries no API key,
        # is answered; without allowed origins browsers keep other sites' pages from reading
        # any answer (same-origin policy) and from sending JSON at all (no preflight passes).
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    for router in ROUTERS:
        app.include_router(router)
    if options.ui:
        app.include_router(ui.router)
    install_openapi(app)
    return app
