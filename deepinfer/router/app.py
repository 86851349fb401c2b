"""The router's FastAPI app: the four generation APIs (proxied), ``/v1/models``, ``/v1/models/{id}``
and ``/v1/messages/count_tokens`` (relayed to an admitted worker), ``/health``, ``/metrics``, and the
operational ``/router/workers`` (status and load of every worker), ``/router/register`` and
``/router/deregister`` (self-registration, ``deepinfer serve --register-with``).

Trust: clients send the router's own API key (``api_key``; checked by the request guard on
``/v1/*``, the API documentation and ``/router/workers``, with the worker's limits and error
shapes); the router never forwards it, and proves itself to workers with the cluster secret, a
header its HTTP client sends on every request (polls, proxied requests, lease releases).
Registration is off unless ``accept_registrations``; when on, a worker must send the cluster key,
checked before the router makes any request to the URL it names.

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
from pydantic import BaseModel, ValidationError

from deepinfer import __version__
from deepinfer.core.load import model_fingerprint
from deepinfer.router.config import RouterConfig
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.policies import DecodeLoad, prefill_policy
from deepinfer.router.prefill_queue import PrefillQueue
from deepinfer.router.proxy import Proxy
from deepinfer.router.registry import REGISTRATION, Registry, WorkerRejected
from deepinfer.router.stream import API_PATHS
from deepinfer.server.middleware import PROTECTED_PREFIXES, RequestGuard
from deepinfer.server.router_api import DEREGISTER_PATH, REGISTER_PATH
from deepinfer.tokenizer import Tokenizer
from deepinfer.web.auth import CLUSTER_KEY_HEADER, has_cluster_key
from deepinfer.web.errors import ApiError, dialect_of, install_error_handlers

ROUTER_PROTECTED = (*PROTECTED_PREFIXES, "/router/workers")  # need the router's API key when it has one


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
        deregister_after_s=config.deregister_after_s,
    )


def http_client(config: RouterConfig) -> httpx.AsyncClient:
    """Connections to workers: a connect timeout (reads are bounded by each request's deadline), and
    the cluster key on every request when the router has a cluster secret."""
    timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    headers = {CLUSTER_KEY_HEADER: config.cluster_secret} if config.cluster_secret else None
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)


class Registration(BaseModel):
    """The body of ``POST /router/register`` and ``/router/deregister``: the worker's URL."""

    url: str


async def registration_url(request: Request) -> str:
    """The worker URL a (de)registration names; ``ApiError`` 400 naming ``url`` otherwise."""
    try:
        url = Registration.model_validate_json(await request.body()).url.rstrip("/")
    except ValidationError as exc:
        raise ApiError(
            400, f'the body must be {{"url": "http://host:port"}}: {exc.errors()[0]["msg"]}', param="url"
        ) from None
    if not url.startswith(("http://", "https://")):
        raise ApiError(400, f"url: {url[:200]!r} is not an http(s) URL", param="url")
    return url


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
    install_error_handlers(app)
    # the worker's credentials check, limits and error shapes, before any parsing (deepinfer.router.proxy)
    app.add_middleware(
        RequestGuard,
        api_key=config.api_key,
        max_body_bytes=config.max_request_bytes,
        body_timeout_s=config.body_timeout_s,
        protected=ROUTER_PROTECTED,
        router_only=(),
    )

    def registrations_open(request: Request) -> None:
        """``ApiError`` 403 unless registration is on, 401/403 unless the request has the cluster key."""
        if not config.accept_registrations:
            raise ApiError(
                403,
                "registration is off at this router: it routes only to the workers named on its command line "
                "(start it with --accept-registrations and a cluster secret to let workers join)",
            )
        if not has_cluster_key(request.headers, config.cluster_secret):
            offered = CLUSTER_KEY_HEADER in request.headers
            raise ApiError(
                403 if offered else 401,
                f"registration needs the cluster secret the router and its workers share, in the "
                f"{CLUSTER_KEY_HEADER} header (deepinfer serve --cluster-secret-file or DEEPINFER_CLUSTER_SECRET)",
            )

    async def relay(method: str, path: str, request: Request) -> Response:
        """``method path`` at an admitted worker (the first that answers), its answer relayed; 503 in
        the API's shape when none is admitted or none answers."""
        registry: Registry = state["registry"]
        body = await request.body() if method == "POST" else None
        headers = {"content-type": request.headers.get("content-type", "application/json")} if body else {}
        if "anthropic-version" in request.headers:  # the worker answers in Anthropic's shapes
            headers["anthropic-version"] = request.headers["anthropic-version"]
        for url in registry.book.urls():
            if registry.admitted(url):
                with contextlib.suppress(httpx.HTTPError):
                    r = await state["proxy"].client.request(
                        method, f"{url}{path}", content=body, headers=headers, timeout=config.poll_timeout_s
                    )
                    media = r.headers.get("content-type", "application/json")
                    return Response(r.content, status_code=r.status_code, media_type=media)
        return ApiError(503, "no worker is admitted", headers={"Retry-After": "1"}).response(dialect_of(path))

    def _route(path: str, api: str):
        async def proxied(request: Request) -> Response:
            return await state["proxy"].handle(api, path, await request.body(), request.headers)

        proxied.__name__ = f"proxy_{api}"
        app.add_api_route(path, proxied, methods=["POST"], include_in_schema=True)

    for path, api in API_PATHS.items():
        _route(path, api)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The served model, as an admitted worker lists it."""
        return await relay("GET", "/v1/models", request)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """One model's card, as an admitted worker answers (404 in OpenAI's shape for another id)."""
        return await relay("GET", request.url.path, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count of a messages request, as an admitted worker counts it."""
        return await relay("POST", "/v1/messages/count_tokens", request)

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

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_route(request: Request) -> Response:
        """The router's Prometheus metrics; ``HEAD`` answers 200 with no body."""
        if request.method == "HEAD":
            return Response(media_type=CONTENT_TYPE)
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

    @app.post(REGISTER_PATH)
    async def register(request: Request) -> JSONResponse:
        """A worker joins (``{"url": ...}``, the cluster key in its headers); it is checked as a worker
        named on the command line is, and takes the role it reports."""
        registrations_open(request)  # before any request to the URL named
        url = await registration_url(request)
        registry: Registry = state["registry"]
        try:
            load = await registry.add(url, REGISTRATION)
        except WorkerRejected as exc:
            raise ApiError(400, str(exc), param="url") from None
        return JSONResponse({"url": url, "role": load.role.value})

    @app.post(DEREGISTER_PATH)
    async def deregister(request: Request) -> JSONResponse:
        """A registered worker leaves (``{"url": ...}``, the cluster key in its headers); idempotent:
        ``deregistered`` says whether it was known. Workers named on the command line stay (403)."""
        registrations_open(request)
        url = await registration_url(request)
        registry: Registry = state["registry"]
        known = registry.registered(url)
        try:
            registry.remove(url, "it deregistered")
        except ValueError as exc:
            raise ApiError(403, str(exc), param="url") from None
        return JSONResponse({"url": url, "deregistered": known})

    return app
