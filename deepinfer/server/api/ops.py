"""Operational routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``.

``/health`` never waits for the engine: it reads flags, so it answers at once even when every
admission slot is taken. It is 503 while the engine core is starting or restarting, after it
failed, and while the server drains; ``degraded`` (200) while a KV store's write-behind thread is
dead (the server still answers, but saved blocks no longer reach the store's files).
"""

from __future__ import annotations

import os
import time
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE

from deepinfer.server.api.common import Serving
from deepinfer.server.protocol.common import ResponseModel
from deepinfer.server.router_api import worker_role
from deepinfer.web.errors import ApiError

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


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: Serving) -> ModelList:
    """The model this server serves."""
    return ModelList(data=[ModelCard(id=ctx.model_name, created=STARTED, max_model_len=ctx.max_model_len)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, ctx: Serving) -> ModelCard:
    """One model by its id (404 unless it is the one served)."""
    if model_id != ctx.model_name:
        raise ApiError(
            404, f"model {model_id!r} does not exist; this server serves {ctx.model_name!r}", param="model"
        )
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


@router.get("/metrics")
async def metrics(ctx: Serving) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
