"""GET / and GET /ui/*: the chat page, static files shipped in the package (`server/ui/`).

A fixed table maps each path to one file, so nothing outside it can be asked for (no path
traversal, no directory listing). The page holds no secrets and loads without the API key
(`gate.py` lets `UI_PATHS` through); it talks to the server only through the public OpenAI
routes, which keep requiring the key. Every file is sent with a Content-Security-Policy that
allows only this origin's scripts, styles and connections (no inline script at all).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from .. import paths

router = APIRouter()

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# path -> (file in server/ui/, media type); the paths are `paths.CHAT_PAGE` and `UI_ASSETS`.
UI_FILES: dict[str, tuple[str, str]] = {
    path: (name, _MEDIA_TYPES[name[name.rindex(".") :]])
    for path, name in [
        (paths.CHAT_PAGE, "index.html"),
        *((asset, asset.rsplit("/", 1)[1]) for asset in paths.UI_ASSETS),
    ]
}
UI_PATHS = frozenset(UI_FILES)

CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "font-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return (resources.files("tallow.server") / "ui" / name).read_bytes()


def _page(path: str):
    name, media_type = UI_FILES[path]

    async def serve() -> Response:
        return Response(_read(name), media_type=media_type, headers=HEADERS)

    serve.__name__ = f"ui_{name.replace('.', '_')}"
    return serve


for _path in UI_FILES:
    router.add_api_route(_path, _page(_path), methods=["GET"], include_in_schema=False)
