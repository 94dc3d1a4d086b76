"""The FastAPI app: routes, API key, body limit, CORS, OpenAI-format errors, metrics.

Every route but ``/health`` sits behind the API key, the OpenAPI spec included; the interactive
docs pages are off (they would load scripts from a CDN).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from . import errors, openai_routes, rag_routes
from .backend import Backend
from .metrics import ServerMetrics
from .security import BodyLimit, api_key_dependency, cors_kwargs
from .settings import ServerSettings
from .state import ServerState


def create_app(backend: Backend, settings: ServerSettings | None = None, close_backend: bool = True) -> FastAPI:
    """The server's app over ``backend``; with ``close_backend`` the app closes it on shutdown."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(backend.queue_depth, backend.running, backend.relay_prompts)
    state = ServerState(backend, settings, metrics)

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
    guarded.include_router(openai_routes.make_router(state))
    guarded.include_router(rag_routes.make_router(state))

    @guarded.get("/metrics", tags=["ops"], response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @guarded.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": backend.model_id, "backend": backend.name}

    app.include_router(guarded)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, **cors_kwargs(settings.cors_origins))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, api_key=settings.api_key)
    return app
