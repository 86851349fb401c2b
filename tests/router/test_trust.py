"""The router's trust boundary (issue 34, defects 1 and 2), against real ``deepinfer router``
processes in front of scripted loopback workers:

- registration is off unless ``--accept-registrations``; when on it needs the cluster key, checked
  before the router makes any request to the URL named (a loopback listener standing in for the
  rogue sees no connection); a registered worker leaves by deregistering, or is forgotten once it
  stays ejected, and ``/health`` is ``ok`` again; a worker named on the command line stays;
- the router checks its own API key on ``/v1/*``, the API documentation and ``/router/workers``
  (401 in each API's error shape), and sends workers the cluster key, never the client's key;
- a router that cannot start says so in one line naming the option.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepinfer.router.cluster import cli_process
from deepinfer.web.auth import CLUSTER_KEY_HEADER, CLUSTER_SECRET_ENV
from tests.router.cluster import Cluster
from tests.router.scripted_worker import ScriptedWorker, scripted_worker

SECRET = "router-trust-tests-secret-0123456789"
KEY = "router-trust-client-key"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class Listener:
    """A loopback TCP listener standing in for a rogue (or a refusing) worker: it counts the
    connections it accepts and answers each with ``reply`` (raw bytes), then closes it. A context
    manager; its thread ends when the block does."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply
        self.connections = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="listener", daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(65536)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


UNAUTHORIZED = b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def router(tmp: Path, name: str, *args: str, secret: str | None = SECRET, key: str | None = None):
    """``deepinfer router ARGS`` (secret and key through the environment) as :func:`cli_process`."""
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, "DEEPINFER_API_KEY")}
    env.update({CLUSTER_SECRET_ENV: secret} if secret else {})
    env.update({"DEEPINFER_API_KEY": key} if key else {})
    return cli_process(("router", *args, "--log-level", "warning"), tmp / f"{name}.log", name, 120, env)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ScriptedWorker]]:
    """A router with an API key and a cluster secret, registration off, over one scripted worker."""
    tmp = tmp_path_factory.mktemp("keyed")
    with scripted_worker() as worker, router(tmp, "keyed", "--both", worker.url, key=KEY) as url:
        yield Cluster(url, tmp / "keyed.log"), worker


@pytest.fixture(scope="module")
def open_registration(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ScriptedWorker]]:
    """A router that accepts registrations (forgetting a registered worker ejected for 1 s), over one
    scripted worker named on its command line."""
    tmp = tmp_path_factory.mktemp("registering")
    args = ("--accept-registrations", "--deregister-after-s", "1", "--poll-interval-s", "0.1")
    with scripted_worker() as worker, router(tmp, "registering", "--both", worker.url, *args) as url:
        yield Cluster(url, tmp / "registering.log"), worker


def register(
    c: Cluster, url: str, headers: dict[str, str] | None = None, path: str = "register"
) -> httpx.Response:
    return httpx.post(f"{c.url}/router/{path}", json={"url": url}, headers=headers, timeout=30)


def test_registration_is_refused_when_off_and_nothing_is_asked_of_the_url(keyed) -> None:
    """Defect 1: a router with registration off (as ``deepinfer cluster`` runs it) admitted any URL,
    sent it clients' requests, and its ``GET {url}/load`` was a blind SSRF."""
    c, _ = keyed
    with Listener() as rogue:
        for headers in (None, {CLUSTER_KEY_HEADER: SECRET}):
            r = register(c, rogue.url, headers)
            assert r.status_code == 403, r.text
            assert "registration is off" in r.json()["error"]["message"]
        time.sleep(0.5)
        assert rogue.connections == 0
    assert rogue.url not in c.health()["workers"] and c.health()["status"] == "ok"


def test_registration_needs_the_cluster_key_before_any_request(open_registration) -> None:
    c, _ = open_registration
    with Listener() as rogue:
        assert register(c, rogue.url).status_code == 401
        assert register(c, rogue.url, {CLUSTER_KEY_HEADER: "x" * 40}).status_code == 403
        assert "cluster secret" in register(c, rogue.url).json()["error"]["message"]
        time.sleep(0.5)
        assert rogue.connections == 0  # refused before the router asked the URL anything
        assert register(c, rogue.url, {CLUSTER_KEY_HEADER: SECRET}).status_code == 400  # not a worker
        assert rogue.connections == 1
    bad = register(c, "file:///etc/passwd", {CLUSTER_KEY_HEADER: SECRET})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    assert set(c.health()["workers"]) == set(httpx.get(f"{c.url}/router/workers", timeout=30).json())


def test_registered_workers_leave_or_are_forgotten_and_health_is_ok_again(open_registration) -> None:
    c, named = open_registration
    key = {CLUSTER_KEY_HEADER: SECRET}
    with scripted_worker() as joining:
        r = register(c, joining.url, key)
        assert r.status_code == 200 and r.json()["role"] == "both", r.text
        assert c.health()["workers"][joining.url] == {
            "role": "both",
            "admitted": True,
            "source": "registration",
        }
        assert register(c, joining.url, path="deregister").status_code == 401
        gone = register(c, joining.url, key, path="deregister")
        assert gone.json() == {"url": joining.url, "deregistered": True}
        assert joining.url not in c.health()["workers"] and c.health()["status"] == "ok"
        assert register(c, joining.url, key).status_code == 200
    # the worker died without deregistering: ejected, then forgotten after --deregister-after-s
    c.wait_for(
        lambda: not c.health()["workers"].get(joining.url, {}).get("admitted"), 15, "the dead worker ejected"
    )
    c.wait_for(lambda: joining.url not in c.health()["workers"], 15, "the dead worker forgotten")
    assert c.health()["status"] == "ok"
    refused = register(c, named.url, key, path="deregister")
    assert refused.status_code == 403 and "named on the command line" in refused.json()["error"]["message"]
    assert named.url in c.health()["workers"]


def test_the_router_checks_its_own_api_key_and_sends_workers_the_cluster_key(keyed) -> None:
    """Defect 2: the router had no API key, and forwarded what the client sent."""
    c, worker = keyed
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
                         ("GET", "/v1/models"), ("GET", "/v1/models/m"), ("GET", "/router/workers"),
                         ("GET", "/docs"), ("GET", "/openapi.json")):  # fmt: skip
        r = httpx.request(method, f"{c.url}{path}", json=CHAT if method == "POST" else None, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error", path
        assert "API key" in r.json()["error"]["message"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(f"{c.url}{path}", json=CHAT, headers={"x-api-key": "wrong"}, timeout=30)
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{c.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{c.url}/metrics", timeout=30).status_code == 200
    seen = len(worker.received)
    ok = httpx.post(
        f"{c.url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert ok.status_code == 200, ok.text
    assert len(worker.received) == seen + 1
    forwarded = worker.received[-1]["headers"]
    assert forwarded[CLUSTER_KEY_HEADER] == SECRET and "authorization" not in forwarded
    workers = httpx.get(f"{c.url}/router/workers", headers={"x-api-key": KEY}, timeout=30)
    assert workers.status_code == 200 and worker.url in workers.json()


def run_router(*args: str, env: dict[str, str] | None = None) -> str:
    """``deepinfer router ARGS``, which must fail at startup: its one stderr line."""
    cmd = [sys.executable, "-m", "deepinfer.cli", "router", "--startup-timeout-s", "5", *args]
    base = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, "DEEPINFER_API_KEY")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**base, **(env or {})})
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_router_that_cannot_be_trusted_does_not_start(tmp_path: Path) -> None:
    line = run_router("--accept-registrations")
    assert "--accept-registrations: registration needs the cluster secret" in line
    assert "--cluster-secret-file PATH or set DEEPINFER_CLUSTER_SECRET" in line
    with Listener(UNAUTHORIZED) as keyed_worker:  # a worker that wants a key the router does not have
        line = run_router("--decode", keyed_worker.url)
    assert line.startswith(
        f"deepinfer router: --decode {keyed_worker.url}: the worker refused the router's load poll"
    )
    assert "--cluster-secret-file PATH or DEEPINFER_CLUSTER_SECRET" in line
    (tmp_path / "short").write_text("short\n")
    line = run_router("--decode", "http://127.0.0.1:9", "--cluster-secret-file", str(tmp_path / "short"))
    assert f"--cluster-secret-file {tmp_path / 'short'}: the cluster secret must be at least 16" in line
    assert "--api-key is empty" in run_router("--decode", "http://127.0.0.1:9", "--api-key", "")
