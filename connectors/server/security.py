"""The API key check and the request-body limit.

The key is compared with ``hmac.compare_digest`` so the time a wrong key takes to reject does not
tell how much of it was right. The body limit is enforced while the body is read, so a client that
lies about (or omits) Content-Length cannot make the server buffer more than the limit.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_response

_bearer = HTTPBearer(auto_error=False, description="the server's API key (`ragfuse serve --api-key`)")


_BAD_KEY = "missing or invalid API key (send `Authorization: Bearer <key>`)"


def _key_ok(given: bytes, expected: bytes | None) -> bool:
    return expected is None or hmac.compare_digest(given, expected)


def api_key_dependency(api_key: str | None) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer <api_key>``
    (every request, when no key is set)."""
    expected = api_key.encode() if api_key else None

    async def require_key(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:  # noqa: B008
        if not _key_ok(creds.credentials.encode() if creds is not None else b"", expected):
            raise APIError(401, _BAD_KEY, code="invalid_api_key")

    return require_key


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``max_bytes`` gets 413 before any route sees it.
    With ``api_key``, a request with a body (POST, PUT, PATCH) and without the key gets its 401 before
    any of the body is read: a client without the key cannot make the server hold bodies in memory."""

    def __init__(self, app: ASGIApp, max_bytes: int, api_key: str | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH") and not _key_ok(_bearer_key(scope), self.expected):
            response = error_response(401, _BAD_KEY, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # read the whole body up to the limit, then replay it to the app
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body larger than the server's limit of {self.max_bytes} bytes",
                                  code="request_too_large")
        await response(scope, receive, send)


def _bearer_key(scope: Scope) -> bytes:
    """The key of an ``Authorization: Bearer <key>`` header (empty without one)."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, key = value.partition(b" ")
            return key.strip() if scheme.lower() == b"bearer" else b""
    return b""


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def cors_kwargs(origins: tuple[str, ...]) -> dict[str, Any]:
    return {"allow_origins": list(origins), "allow_methods": ["GET", "POST", "DELETE"],
            "allow_headers": ["Authorization", "Content-Type"], "allow_credentials": False}
