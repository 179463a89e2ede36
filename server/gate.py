"""The gate in front of every route: the API key, and 503 while the server drains."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .context import ServerOptions, ServerState
from .errors import APIError
from .routes.ui import UI_PATHS


class APIGate:
    """Pure ASGI middleware (so streaming and disconnects pass through untouched): API key
    on every route but /health and GETs of the chat page's files (they hold no secrets; the page
    asks for the key and sends it to the API routes), and 503 for new requests while
    draining."""

    def __init__(self, app: ASGIApp, options: ServerOptions, state: ServerState) -> None:
        self.app, self.options, self.state = app, options, state
        key = options.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._open = UI_PATHS if options.ui else frozenset()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        page = scope["method"] == "GET" and scope["path"] in self._open
        if self._expected is not None and not page:
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
