"""The FastAPI application: routes, error handlers, the request guard, and the engine thread's
lifetime (started with the app, stopped when it shuts down)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from deepinfer import __version__
from deepinfer.router import worker as router_worker
from deepinfer.server.api import chat, completions, messages, ops, responses
from deepinfer.server.async_engine import AsyncEngine
from deepinfer.server.config import ServerConfig
from deepinfer.server.context import ServingContext
from deepinfer.server.errors import install_error_handlers
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.middleware import RequestGuard

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """An app serving ``engine``. The engine thread starts when the app starts (ASGI lifespan)."""
    async_engine = AsyncEngine(engine, config.max_queued_requests)
    metrics = ServerMetrics(lambda: async_engine.stats, lambda: async_engine.num_in_flight)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(
        title="deepinfer",
        version=__version__,
        summary="OpenAI- and Anthropic-compatible API for DeepSeek-family models",
        lifespan=lifespan,
    )
    app.state.serving = ServingContext(async_engine, config.served_model_name, metrics, config.retry_after_s)
    for api in (chat, completions, responses, messages, ops, router_worker):
        app.include_router(api.router)
    app.state.worker = router_worker.worker_identity(engine, config.role)
    router_worker.role_gauge(metrics.registry, config.role)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_request_bytes)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document, saying what the server really answers to an invalid request:
    400 in the API's error shape (FastAPI documents its own 422)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            if operation.get("responses", {}).pop("422", None) is not None:
                operation["responses"]["400"] = {"description": "Invalid request; the error names the field"}
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema
