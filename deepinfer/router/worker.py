"""The worker's side of the router protocol, mounted on ``deepinfer serve``: ``GET /load`` (the
:class:`~deepinfer.router.load.WorkerLoad` routers poll; also their health check), the role gauge in
``/metrics``, and self-registration with a router (``--register-with URL``).

What it needs from the server: the ``ServingContext`` on ``app.state.serving`` (its ``engine`` with
``stats.load``, ``healthy`` and ``num_in_flight``, and ``model_name``) and a :class:`WorkerIdentity`
on ``app.state.worker`` (built once at startup by :func:`worker_identity`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Gauge

from deepinfer.logger import get_logger
from deepinfer.router.load import (
    LOAD_PATH,
    CostModel,
    WorkerLoad,
    kv_layout_fingerprint,
    model_fingerprint,
    step_cost_model,
)
from deepinfer.router.roles import Role

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine

logger = get_logger(__name__)
REGISTER_PATH = "/router/register"
router = APIRouter()


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What a worker reports that does not change while it runs."""

    role: Role
    model_fingerprint: str
    kv_layout: str
    cost_model: CostModel


def worker_identity(engine: LLMEngine, role: Role) -> WorkerIdentity:
    return WorkerIdentity(
        role,
        model_fingerprint(engine.config.model, engine.config.tokenizer),
        kv_layout_fingerprint(engine),
        CostModel.of(step_cost_model(engine)),
    )


def role_gauge(registry: CollectorRegistry, role: Role) -> None:
    """``deepinfer_worker_role{role=...} 1`` in the server's metrics."""
    Gauge(
        "deepinfer_worker_role", "This worker's role (the labelled series is 1)", ["role"], registry=registry
    ).labels(role=role.value).set(1)


@router.get(LOAD_PATH)
async def load(request: Request) -> Response:
    """The worker's identity and load, for routers (JSON :class:`WorkerLoad`)."""
    ctx, ident = request.app.state.serving, request.app.state.worker
    engine = ctx.engine
    body = WorkerLoad(
        model=ctx.model_name,
        model_fingerprint=ident.model_fingerprint,
        kv_layout=ident.kv_layout,
        role=ident.role,
        healthy=engine.healthy,
        num_in_flight=engine.num_in_flight,
        engine=engine.stats.load,
        cost_model=ident.cost_model,
    )
    return Response(msgspec.json.encode(body), media_type="application/json")


def advertised_url(host: str, port: int) -> str:
    """The URL others reach this server at (a wildcard address becomes the host's name)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


class Registration:
    """Registers ``own_url`` with the router at ``router_url`` once the server answers, then again
    every ``interval_s`` (a heartbeat: a restarted router relearns its workers). A daemon thread;
    ``stop`` ends it."""

    def __init__(self, router_url: str, own_url: str, interval_s: float = 5.0) -> None:
        self.router_url = router_url.rstrip("/")
        self.own_url = own_url
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-register", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import httpx

        registered = False
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.own_url}/health", timeout=2).status_code == 200:
                    r = httpx.post(
                        f"{self.router_url}{REGISTER_PATH}", json={"url": self.own_url}, timeout=10
                    )
                    if r.status_code == 200 and not registered:
                        logger.info("registered with the router at %s as %s", self.router_url, self.own_url)
                    elif r.status_code != 200:
                        logger.warning(
                            "the router at %s refused registration: %s", self.router_url, r.text[:300]
                        )
                    registered = r.status_code == 200
            self._stop.wait(self.interval_s if registered else 0.5)
