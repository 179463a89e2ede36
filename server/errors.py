"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure path goes through `APIError`, so clients (the `openai` SDK among them) get the
status they branch on and a body they can parse; nothing a client sends may surface as a 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            ErrorResponse(error=self.info).model_dump(), self.status, headers=self.headers
        )


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, named by its top-level field."""
    errors = e.errors(include_url=False)
    # In a union (`stop: str | list[str]`) pydantic reports every member; the member whose
    # type matched but whose value did not is the one worth telling the client about.
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    loc = err.get("loc") or ()
    param = str(loc[0]) if loc else None
    where = ".".join(str(p) for p in loc if isinstance(p, int) or not _is_type_tag(p))
    message = f"{where}: {err['msg']}" if where else err["msg"]
    code = "missing_parameter" if err["type"] == "missing" else "invalid_value"
    if err["type"] in ("string_type", "int_type", "float_type", "bool_type", "list_type"):
        code = "invalid_type"
    if err["type"] == "dict_type" and loc:
        code = "invalid_type"
    return bad_request(message, param, code)


def _is_type_tag(part: object) -> bool:
    # Pydantic names the union member that failed ("str", "list[int]"); it is noise to users.
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code, headers=e.headers).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        # Nobody is left to read an answer; one line, not a traceback.
        client = request.client.host if request.client else "?"
        log.info("client %s left while sending %s %s", client, request.method, request.url.path)
        return APIError(400, "the client disconnected", code="client_disconnected").response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        # Starlette re-raises after this answer and uvicorn then drops the connection: say
        # so, or a client that keeps it alive sends its next request into a closed socket
        # (the fuzz campaign saw that request fail with a ReadError).
        return APIError(
            500,
            f"internal error: {type(e).__name__}",
            type="server_error",
            code="internal_error",
            headers={"Connection": "close"},
        ).response()
