"""The API routes, one module per route group; `create_app` includes `ROUTERS`, and
`ui.router` (the chat page at /) unless `ServerOptions.ui` is off.

Each route lives in one module here, at a path from `server/paths.py`
(tests/test_server_routes.py and tests/test_docs_drift.py check both).
"""

from fastapi import APIRouter

from . import chat, completions, embeddings, health, models, responses, tokenize

ROUTERS: tuple[APIRouter, ...] = (
    chat.router,
    completions.router,
    responses.router,
    embeddings.router,
    models.router,
    tokenize.router,
    health.router,
)

__all__ = ["ROUTERS"]
