"""The worker's side of the router protocol, mounted on ``deepinfer serve``: ``GET /load`` (the
:class:`~deepinfer.core.load.WorkerLoad` routers poll; also their health check), the role gauge in
``/metrics``, and self-registration with a router (``--register-with URL``).

What it needs from the server: the ``ServingContext`` on ``app.state.serving`` (its ``client``:
``info``, the first core's ``Ready`` with the node role, KV layout fingerprint and cost model;
``stats.load``; ``healthy``; ``num_in_flight``; and ``config``: served model name, ``role`` and the
model folder's fingerprint, ``model_fingerprint``). The role is the configured one, else the node
role the engine core reports once it is ready. Who may read ``/load`` is the request guard's call
(``deepinfer.server.middleware``: the cluster key, or the API key on a worker without a cluster
secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.core.load import LOAD_PATH, WorkerLoad
from deepinfer.core.roles import Role
from deepinfer.logger import get_logger
from deepinfer.web.auth import CLUSTER_KEY_HEADER

logger = get_logger(__name__)
REGISTER_PATH = "/router/register"
DEREGISTER_PATH = "/router/deregister"
router = APIRouter()


def worker_role(ctx) -> Role | None:
    """The worker's role: configured, else the engine core's node role (``None`` until it is ready)."""
    if ctx.config.role is not None:
        return ctx.config.role
    info = ctx.client.info
    return Role(info.node_role) if info is not None else None


class _RoleCollector(Collector):
    def __init__(self, ctx) -> None:
        self._ctx = ctx

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "deepinfer_worker_role", "This worker's role (the labelled series is 1)", labels=["role"]
        )
        role = worker_role(self._ctx)
        if role is not None:
            family.add_metric([role.value], 1)
        yield family


def role_gauge(registry: CollectorRegistry, ctx) -> None:
    """``deepinfer_worker_role{role=...} 1`` in the server's metrics (once the role is known)."""
    registry.register(_RoleCollector(ctx))


@router.get(LOAD_PATH)
async def load(request: Request) -> Response:
    """The worker's identity and load, for routers (JSON :class:`WorkerLoad`); 503 until its engine
    core is ready."""
    ctx = request.app.state.serving
    client, info = ctx.client, ctx.client.info
    if info is None or info.cost_model is None:
        return Response(
            b'{"error": "the engine core is not ready yet"}', status_code=503, media_type="application/json"
        )
    body = WorkerLoad(
        model=ctx.model_name,
        model_fingerprint=ctx.config.model_fingerprint,
        kv_layout=info.kv_layout,
        role=worker_role(ctx),
        healthy=client.healthy and not ctx.draining,
        num_in_flight=client.num_in_flight,
        engine=client.stats.load,
        cost_model=info.cost_model,
        **await asyncio.to_thread(_handoff_state, request.app.state.kv_transfer),
    )
    return Response(msgspec.json.encode(body), media_type="application/json")


def _handoff_state(kvt) -> dict:
    return {"kv_store_id": kvt.store_id(), "kv_leases": kvt.live_leases()}


def advertised_url(host: str, port: int) -> str:
    """The URL others reach this server at (a wildcard address becomes the host's name)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


class Registration:
    """Registers ``own_url`` with the router at ``router_url`` once the server answers, then again
    every ``interval_s`` (a heartbeat: a restarted router relearns its workers), proving itself with
    the cluster secret ``cluster_secret``. A daemon thread; ``stop`` ends it and deregisters the
    worker (``POST /router/deregister``), so the router forgets it at once."""

    def __init__(self, router_url: str, own_url: str, cluster_secret: str, interval_s: float = 5.0) -> None:
        self.router_url = router_url.rstrip("/")
        self.own_url = own_url
        self.interval_s = interval_s
        self._headers = {CLUSTER_KEY_HEADER: cluster_secret}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-register", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the heartbeat and deregister (waits up to ``timeout_s`` for the router's answer)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        import httpx

        registered = False
        with httpx.Client(headers=self._headers) as client:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.own_url}/health", timeout=2).status_code == 200:
                        r = client.post(
                            f"{self.router_url}{REGISTER_PATH}", json={"url": self.own_url}, timeout=10
                        )
                        if r.status_code == 200 and not registered:
                            logger.info(
                                "registered with the router at %s as %s", self.router_url, self.own_url
                            )
                        elif r.status_code != 200:
                            logger.warning(
                                "the router at %s refused registration: %s", self.router_url, r.text[:300]
                            )
                        registered = r.status_code == 200
                self._stop.wait(self.interval_s if registered else 0.5)
            if registered:
                try:
                    client.post(f"{self.router_url}{DEREGISTER_PATH}", json={"url": self.own_url}, timeout=3)
                    logger.info("deregistered from the router at %s", self.router_url)
                except httpx.HTTPError as exc:  # the router then forgets it once it stays ejected
                    logger.warning("could not deregister from the router at %s: %s", self.router_url, exc)
