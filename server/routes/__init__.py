"""The API routes, one module per route group; `create_app` includes `ROUTERS`, and
`ui.router` (the chat page at /) unless `ServerOptions.ui` is off.

Each path has exactly one home here (tests/test_server_routes.py checks the table).
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
