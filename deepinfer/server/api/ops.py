"""Operational routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``
(and ``HEAD /metrics``).

The model routes answer in OpenAI's shape, or in Anthropic's (``ModelInfo`` objects; a list with
``has_more``, ``first_id``, ``last_id``) when the request carries the ``anthropic-version`` header,
as Anthropic's clients send on every call.

``/health`` never waits for the engine: it reads flags, so it answers at once even when every
admission slot is taken. It is 503 while the engine core is starting or restarting, after it
failed, and while the server drains; ``degraded`` (200) while a KV store's write-behind thread is
dead (the server still answers, but saved blocks no longer reach the store's files).
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE

from deepinfer.server.api.common import Serving
from deepinfer.server.protocol.common import ResponseModel
from deepinfer.server.router_api import worker_role
from deepinfer.web.errors import ApiError, Dialect

router = APIRouter()
STARTED = int(time.time())


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AnthropicModelInfo(ResponseModel):
    """A model in Anthropic's shape (``created_at``: RFC 3339, the time the server started)."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    lifecycle: Literal["active"] = "active"
    max_input_tokens: int


class AnthropicModelList(ResponseModel):
    """Anthropic's model list: one page, ``first_id`` / ``last_id`` its first and last ids."""

    data: list[AnthropicModelInfo]
    has_more: bool = False
    first_id: str | None
    last_id: str | None


ANTHROPIC_VERSION_HEADER = "anthropic-version"


def _anthropic(request: Request) -> bool:
    return ANTHROPIC_VERSION_HEADER in request.headers


def _anthropic_info(ctx: Serving) -> AnthropicModelInfo:
    created = datetime.fromtimestamp(STARTED, UTC).isoformat().replace("+00:00", "Z")
    return AnthropicModelInfo(
        id=ctx.model_name, display_name=ctx.model_name, created_at=created, max_input_tokens=ctx.max_model_len
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request, ctx: Serving) -> ModelList | JSONResponse:
    """The model this server serves (Anthropic's list shape with the ``anthropic-version`` header)."""
    if _anthropic(request):
        info = _anthropic_info(ctx)
        page = AnthropicModelList(data=[info], first_id=info.id, last_id=info.id)
        return JSONResponse(page.model_dump(mode="json"))
    return ModelList(data=[ModelCard(id=ctx.model_name, created=STARTED, max_model_len=ctx.max_model_len)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request, ctx: Serving) -> ModelCard | JSONResponse:
    """One model by its id (404 unless it is the one served); Anthropic's ``ModelInfo`` and error
    shape with the ``anthropic-version`` header."""
    if model_id != ctx.model_name:
        error = ApiError(
            404, f"model {model_id!r} does not exist; this server serves {ctx.model_name!r}", param="model"
        )
        if _anthropic(request):
            return error.response(Dialect.ANTHROPIC)
        raise error
    if _anthropic(request):
        return JSONResponse(_anthropic_info(ctx).model_dump(mode="json"))
    return ModelCard(id=ctx.model_name, created=STARTED, max_model_len=ctx.max_model_len)


@router.get("/health")
async def health(ctx: Serving) -> JSONResponse:
    """200 while an engine core serves and the server admits requests; 503 otherwise, with why."""
    client = ctx.client
    if ctx.draining:
        reason = "the server is shutting down"
    elif client.healthy:
        role = worker_role(ctx)
        body = {"status": "ok", "role": role.value, "pid": os.getpid(), "engine_cores": client.core_pids()}
        dead = [
            i
            for i, s in client.core_stats().items()
            if s.kv_store is not None and not s.kv_store["writer_alive"]
        ]
        if dead:  # it still serves, but saved blocks no longer reach the store's files
            body["status"] = "degraded"
            body["reason"] = (
                f"the KV store's write-behind thread died in engine core(s) {dead}: saves stay in memory"
            )
        return JSONResponse(body)
    else:
        reason = client.error or "the engine core is starting"
    return JSONResponse(
        {"status": "unavailable", "reason": reason},
        status_code=503,
        headers={"Retry-After": str(ctx.retry_after_s)},
    )


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(request: Request, ctx: Serving) -> Response:
    """Prometheus metrics (text exposition format); ``HEAD`` answers 200 with no body."""
    if request.method == "HEAD":
        return Response(media_type=CONTENT_TYPE)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
