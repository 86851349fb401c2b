"""Operational routes: ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

``/health`` never waits for the engine: it reads a flag, so it answers at once even when every
admission slot is taken.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.server.api.common import Serving
from deepinfer.server.metrics import CONTENT_TYPE
from deepinfer.server.protocol.common import ResponseModel

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


@router.get("/health")
async def health(ctx: Serving, request: Request) -> JSONResponse:
    """200 while the engine thread runs, 503 once it has failed."""
    role = request.app.state.worker.role.value
    if ctx.engine.healthy:
        return JSONResponse({"status": "ok", "role": role})
    return JSONResponse(
        {"status": "unavailable", "role": role, "reason": repr(ctx.engine.error)}, status_code=503
    )


@router.get("/metrics")
async def metrics(ctx: Serving) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
