"""The FastAPI app: routes, API key, body limit, CORS, OpenAI-format errors, metrics.

Every route but ``/health`` sits behind the API key, the OpenAPI spec included; the interactive
docs pages are off (they would load scripts from a CDN).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from . import errors, openai_routes, rag_routes
from .backend import Backend, CacheUsage
from .metrics import ServerMetrics
from .security import BodyLimit, api_key_dependency, cors_kwargs
from .settings import ServerSettings
from .state import ServerState


def create_app(backend: Backend, settings: ServerSettings | None = None, close_backend: bool = True) -> FastAPI:
    """The server's app over ``backend``; with ``close_backend`` the app closes it on shutdown."""
    settings = settings or ServerSettings()
    usage = cast(Callable[[], CacheUsage], backend.cache_usage) if backend.cache_usage() is not None else None
    metrics = ServerMetrics(backend.queue_depth, backend.running, backend.relay_prompts, usage)
    state = ServerState(backend, settings, metrics)
    # FastAPI keeps the route and dependency functions it inspects in process-wide caches (4096 of
    # them, in fastapi.dependencies.models): what they hold strongly outlives the app, so every app
    # made in a process (a server restarted in-process, each server test) kept its backend, with the
    # engine's weights and KV cache and the open stores, for good. The routes reach the state weakly
    # and the app itself through the request; the app holds the state (``app.state.server``).
    live = cast(ServerState, weakref.proxy(state))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        yield
        if close_backend:
            backend.close()

    app = FastAPI(title="ragfuse", summary="OpenAI-compatible API with RAG over fused KV", version="1",
                  docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = state
    errors.install(app)
    guarded = APIRouter(dependencies=[Depends(api_key_dependency(settings.api_key))])
    guarded.include_router(openai_routes.make_router(live))
    guarded.include_router(rag_routes.make_router(live))

    @guarded.get("/metrics", tags=["ops"], response_class=Response)
    async def prometheus() -> Response:
        return Response(live.metrics.render(), media_type="text/plain; version=0.0.4")

    @guarded.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> dict[str, Any]:
        return request.app.openapi()

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": live.backend.model_id, "backend": live.backend.name}

    app.include_router(guarded)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, **cors_kwargs(settings.cors_origins))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, api_key=settings.api_key)
    return app
