"""The router's FastAPI app: the four generation APIs (proxied), ``/v1/models``, ``/health``,
``/metrics``, and the operational ``/router/workers`` (status and load of every worker) and
``/router/register`` (self-registration, ``deepinfer serve --register-with``).

Startup (ASGI lifespan) admits the configured workers, checking each (:class:`Registry`), sets up the
prefill queue (late binding, estimated-compute only) and starts the health/load poller; shutdown stops it and closes the HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
from pydantic import BaseModel

from deepinfer import __version__
from deepinfer.core.load import model_fingerprint
from deepinfer.router.config import RouterConfig
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.policies import DecodeLoad, prefill_policy
from deepinfer.router.prefill_queue import PrefillQueue
from deepinfer.router.proxy import Proxy
from deepinfer.router.registry import Registry, WorkerRejected
from deepinfer.router.stream import API_PATHS
from deepinfer.server.middleware import RequestGuard
from deepinfer.tokenizer import Tokenizer
from deepinfer.web.errors import ApiError, Dialect


def model_folder(config: RouterConfig) -> str:
    from deepinfer.model_zoo import default_model_path

    return str(config.model or default_model_path())


def make_registry(config: RouterConfig, client: httpx.AsyncClient, metrics: RouterMetrics) -> Registry:
    folder = model_folder(config)
    return Registry(
        client,
        metrics,
        config.poll_interval_s,
        config.poll_timeout_s,
        config.eject_after,
        model_fingerprint(folder),
        f"--model {folder}",
    )


def http_client(config: RouterConfig) -> httpx.AsyncClient:
    """Connections to workers: a connect timeout; reads are bounded by each request's deadline."""
    timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


class Registration(BaseModel):
    url: str


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router app for ``config`` (workers are admitted when it starts)."""
    metrics = RouterMetrics()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = http_client(config)
        registry = make_registry(config, client, metrics)
        try:
            await registry.add_configured(config.workers(), config.startup_timeout_s)
            tokenizer = await asyncio.to_thread(Tokenizer, model_folder(config))
            prefill, decode = (
                prefill_policy(config.prefill_policy),
                DecodeLoad(config.decode_request_weight_tokens),
            )
            queue = None
            if config.prefill_policy == "estimated-compute" and config.prefill_queue_limit:
                queue = PrefillQueue(
                    config.prefill_horizon_s,
                    config.prefill_queue_limit,
                    config.poll_interval_s,
                    on_wait=metrics.prefill_queued.inc,
                )
                registry.listeners.append(queue.kick)
                metrics.prefill_queue_depth.set_function(lambda: queue.depth)
            state["proxy"] = Proxy(config, registry, client, tokenizer, prefill, decode, metrics, queue)
            state["registry"] = registry
            metrics.watch_workers(
                lambda: [
                    (registry.book.view(u), registry.book.report(u).engine.busy_s)
                    for u in registry.book.urls()
                ]
            )
            poller = asyncio.create_task(registry.poll_forever())
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
        finally:
            await client.aclose()

    app = FastAPI(title="deepinfer router", version=__version__, lifespan=lifespan)
    # the worker's limits and error shapes, before any parsing (deepinfer.router.proxy)
    app.add_middleware(
        RequestGuard,
        api_key=None,
        max_body_bytes=config.max_request_bytes,
        body_timeout_s=config.body_timeout_s,
    )

    def _route(path: str, api: str):
        async def proxied(request: Request) -> Response:
            return await state["proxy"].handle(api, path, await request.body(), request.headers)

        proxied.__name__ = f"proxy_{api}"
        app.add_api_route(path, proxied, methods=["POST"], include_in_schema=True)

    for path, api in API_PATHS.items():
        _route(path, api)

    @app.get("/v1/models")
    async def models() -> Response:
        registry: Registry = state["registry"]
        for url in registry.book.urls():
            if registry.admitted(url):
                with contextlib.suppress(httpx.HTTPError):
                    r = await state["proxy"].client.get(f"{url}/v1/models", timeout=config.poll_timeout_s)
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
        return ApiError(503, "no worker is admitted").response(Dialect.OPENAI)

    @app.get("/health")
    async def health() -> JSONResponse:
        """``ok`` (200) when every worker is admitted, ``degraded`` (200) while some are ejected but
        one can decode, ``unavailable`` (503) otherwise."""
        registry: Registry = state["registry"]
        workers = registry.status()
        admitted = [w for w in workers.values() if w["admitted"]]
        if workers and len(admitted) == len(workers):
            status = "ok"
        elif any(w["role"] in ("decode", "both") for w in admitted):
            status = "degraded"
        else:
            status = "unavailable"
        return JSONResponse(
            {"status": status, "workers": workers}, status_code=503 if status == "unavailable" else 200
        )

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/router/workers")
    async def workers() -> JSONResponse:
        """Every worker: role, admission, the router's view of its load, and its busy seconds."""
        registry: Registry = state["registry"]
        out = {}
        for url, status in registry.status().items():
            view, report = registry.book.view(url), registry.book.report(url)
            out[url] = {
                **status,
                "active_requests": view.active_requests,
                "prefill_backlog_s": view.prefill_backlog_s,
                "prefill_slowdown": view.slowdown,
                "kv_tokens_held": view.kv_tokens_held,
                "busy_s": report.engine.busy_s,
                "cost_model": msgspec.structs.asdict(report.cost_model),
            }
        return JSONResponse(out)

    @app.post("/router/register")
    async def register(body: Registration) -> JSONResponse:
        registry: Registry = state["registry"]
        try:
            load = await registry.add(body.url.rstrip("/"), "registration")
        except WorkerRejected as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"url": body.url, "role": load.role.value})

    return app
