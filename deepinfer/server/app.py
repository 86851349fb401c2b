"""The FastAPI application: routes, error handlers, the request guard, and the engine client's
lifetime (its cores start with the app and are shut down with it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from deepinfer import __version__
from deepinfer.core.client import EngineClient
from deepinfer.server import kv_transfer, router_api
from deepinfer.server.api import chat, completions, messages, ops, responses
from deepinfer.server.config import ServerConfig
from deepinfer.server.context import ServingContext
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.middleware import RequestGuard
from deepinfer.tokenizer import Tokenizer
from deepinfer.web.errors import install_error_handlers


def build_app(client: EngineClient, config: ServerConfig, tokenizer: Tokenizer | None) -> FastAPI:
    """An app serving through ``client``. The app's startup starts the client's cores and waits
    until they are ready (ASGI lifespan); its shutdown stops them."""
    metrics = ServerMetrics(
        lambda: client.stats,
        lambda: client.num_in_flight,
        client.core_stats,
        lambda: client.dropped_messages,
        lambda: client.weight_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(
        title="deepinfer",
        version=__version__,
        summary="OpenAI- and Anthropic-compatible API for DeepSeek-family models",
        lifespan=lifespan,
    )
    app.state.serving = ServingContext(client, config, metrics, tokenizer)
    for api in (chat, completions, responses, messages, ops, router_api):
        app.include_router(api.router)
    router_api.role_gauge(metrics.registry, app.state.serving)
    install_error_handlers(app)
    kv_transfer.install(app, app.state.serving, metrics.registry)  # its middleware runs inside the guard
    app.add_middleware(
        RequestGuard,
        api_key=config.api_key,
        cluster_secret=config.cluster_secret,
        max_body_bytes=config.max_request_bytes,
        body_timeout_s=config.body_timeout_s,
    )
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
