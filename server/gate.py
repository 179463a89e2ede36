"""The gate in front of every route: the Host header, the API key, and 503 while the server
drains.

The Host check defends against DNS rebinding: a web page on `evil.example` whose name the
attacker re-points at 127.0.0.1 makes the browser send requests (and read the answers) with
`Host: evil.example`. Allowed by default: localhost names (`localhost`, `*.localhost`), IP
literals (a rebinding needs a name the attacker controls; an address is never one), the bind
address, and, when bound to every interface, this machine's own names. `--allowed-hosts` adds
names (`*.example.com` for a domain's subdomains, `*` for any host). A request without Host
(HTTP/1.0, not a browser) passes.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket

from starlette.types import ASGIApp, Receive, Scope, Send

from . import paths
from .context import ServerOptions, ServerState
from .errors import APIError
from .routes.ui import UI_PATHS

_WILDCARD_BINDS = {"", "0.0.0.0", "::", "[::]"}


def host_name(header: str) -> str:
    """The name in a Host header: no port, no IPv6 brackets, lower case, no trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_host_names(options: ServerOptions) -> tuple[set[str], tuple[str, ...], bool]:
    """(exact names, `.suffix`es, any host) the Host check accepts."""
    exact = {"localhost"}
    suffixes = [".localhost"]
    bind = host_name(options.host)
    if bind in _WILDCARD_BINDS:
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                exact.add(host_name(name))
    elif bind:
        exact.add(bind)
    any_host = False
    for entry in options.allowed_hosts:
        name = host_name(entry)
        if name == "*":
            any_host = True
        elif name.startswith("*."):
            suffixes.append(name[1:])
        elif name:
            exact.add(name)
    return exact, tuple(suffixes), any_host


class APIGate:
    """Pure ASGI middleware (so streaming and disconnects pass through untouched): the Host
    check on every route; the API key on every route but the health probes and GETs of the chat
    page's files (they hold no secrets; the page asks for the key and sends it to the API
    routes); and 503 for new requests while draining (the probes still answer)."""

    def __init__(self, app: ASGIApp, options: ServerOptions, state: ServerState) -> None:
        self.app, self.options, self.state = app, options, state
        key = options.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._open = UI_PATHS if options.ui else frozenset()
        self._hosts, self._host_suffixes, self._any_host = allowed_host_names(options)

    def host_allowed(self, header: bytes | None) -> bool:
        if header is None or self._any_host:
            return True
        name = host_name(header.decode("latin-1"))
        return name in self._hosts or name.endswith(self._host_suffixes) or _is_ip(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self.host_allowed(headers.get(b"host")):
            err = APIError(
                400,
                "the Host header names a host this server does not answer for "
                "(start it with --allowed-hosts to add one)",
                code="invalid_host",
            )
            return await err.response()(scope, receive, send)
        if scope["path"] in paths.PROBES:  # no key, and answered while draining
            return await self.app(scope, receive, send)
        page = scope["method"] == "GET" and scope["path"] in self._open
        if self._expected is not None and not page:
            got = headers.get(b"authorization", b"")
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
