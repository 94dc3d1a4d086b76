"""Errors in OpenAI's format (``{"error": {"message", "type", "param", "code"}}``), never a traceback.

OpenAI clients parse this shape to raise their typed exceptions (``BadRequestError``,
``AuthenticationError``...), so every failure the server reports goes through here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragfuse.engine.errors import EngineStopped, RagfuseError
from ragfuse.engine.kvstore.disk import DiskFullError
from ragfuse.engine.kvstore.entry import KVStoreError

log = logging.getLogger("ragfuse.server")
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         500: "server_error", 501: "not_implemented_error", 503: "server_error", 507: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientDisconnected(Exception):
    """The client of a non-streamed request went away before its answer: answered quietly with a 499
    nobody reads (``install``). Raised as a CancelledError it reached the ASGI server as a
    crash, which logged a full traceback for every client that gave up waiting."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def describe_error(exc: BaseException) -> tuple[int, str]:
    """Status and message for an exception raised while serving (also used mid-stream)."""
    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, DiskFullError):  # the server's storage, not the request: 507, as WebDAV named it
        return 507, str(exc)
    # a KV tier failing (Redis gone, I/O errors) or the server stopping: not the request's fault, a retry may succeed
    if isinstance(exc, KVStoreError | EngineStopped):
        return 503, str(exc)
    if isinstance(exc, RagfuseError):  # the project's user errors: bad request, missing store...
        return 400, str(exc)
    log.error("internal error", exc_info=exc)
    return 500, "internal server error (see the server log)"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = validation_message(list(exc.errors()))
        return error_response(400, f"{param + ': ' if param else ''}{message}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # the routing's headers kept: a 405 must say which methods are allowed (``Allow``)
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": in the access log, read by no one

    @app.exception_handler(RagfuseError)
    async def _ragfuse(_: Request, exc: RagfuseError) -> JSONResponse:
        return error_response(*describe_error(exc))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        return error_response(*describe_error(exc))


# what pydantic puts in an error's location besides field names: where the value sat in the request,
# and, for a field that takes one of several types, which of them was tried
_PLACES = {"body", "query", "path", "header"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str | None, str]:
    """The request's first invalid field as clients name it (``stop``, ``messages.0.content``) and
    what it should have been. A field of several types fails once per type, each error located by a
    tag of pydantic's (``stop.constrained-str``, ``stop.list[str]``): the tags are left out and the
    tries joined ("a valid string or a valid list"), not the first try shown as if it were the rule."""
    if not errors:
        return None, "invalid request"
    if errors[0].get("type") == "json_invalid":  # located at the character offset, which is no field
        return None, f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', 'unreadable')}"

    def field_path(error: dict[str, Any]) -> str | None:
        parts = [str(p) for p in error.get("loc", ()) if p not in _PLACES and not _is_type_tag(p)]
        return ".".join(parts) or None

    paths = [field_path(e) for e in errors]
    if paths[0] is None and errors[0].get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return None, "the request body must be a JSON object, sent as Content-Type: application/json"
    # a try that got past the field's type (a list, one of whose items is wrong) tells what to fix;
    # "a valid string" for a list of token ids with a bad id in it would not
    param = next((p for p in paths if p and paths[0] and p.startswith(paths[0] + ".")), paths[0])
    tries = dict.fromkeys(str(e.get("msg", "invalid value")) for e, p in zip(errors, paths, strict=True) if p == param)
    return param, " or ".join(m if i == 0 else m.removeprefix("Input should be ") for i, m in enumerate(tries))


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or not part.isidentifier())

