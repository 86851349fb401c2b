"""The router's input handling (issue 34, defects 4, 5 and the metrics half of 6), against a real
``deepinfer router`` process in front of a scripted worker (a real HTTP server on loopback):

- a body over the limit is refused (413) before it is read whole: a 64 MB body in well under a
  second, the router's RSS staying low and its ``/health`` answering meanwhile;
- deep nesting and lone surrogates are a 400 in the API's shape, as at a worker, never a 500;
- a client's ``kv_transfer`` is refused (400 naming it) and never reaches a worker, nor do the
  client's credentials;
- a stream that breaks after its first output counts as an ``error`` in the request metrics, a
  stream the client leaves as ``cancelled``, a complete one as ``ok``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepinfer.router.cluster import cli_process
from tests.router.cluster import Cluster
from tests.router.scripted_worker import ScriptedWorker, scripted_worker

SECRET = "router-input-tests-secret-0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def _pid_serving(port: int) -> int:
    """The PID of the ``deepinfer`` process started with ``--port port``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if (
                    b"deepinfer.cli" in argv
                    and b"--port" in argv
                    and argv[argv.index(b"--port") + 1] == str(port).encode()
                ):
                    return int(entry.name)
    raise AssertionError(f"no deepinfer process with --port {port}")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ScriptedWorker, int]]:
    """``deepinfer router --both <scripted worker>``: the router (as a ``Cluster`` for its helpers),
    the worker and the router's PID."""
    tmp = tmp_path_factory.mktemp("router-input")
    env = {**os.environ, "DEEPINFER_CLUSTER_SECRET": SECRET}
    with scripted_worker() as worker:
        args = ("router", "--both", worker.url, "--log-level", "warning")
        with cli_process(args, tmp / "router.log", "deepinfer router", 120, env) as url:
            yield Cluster(url, tmp / "router.log"), worker, _pid_serving(int(url.rsplit(":", 1)[1]))


def requests_total(c: Cluster, api: str, outcome: str) -> float:
    return c.metric(f'deepinfer_router_requests_total{{api="{api}",outcome="{outcome}",path="short"}}')


def test_a_64_mb_body_is_refused_at_once_and_health_stays_responsive(routed) -> None:
    c, worker, pid = routed
    seen = len(worker.received)
    before_mb = _rss_mb(pid)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (64 << 20) + b'"}]}'
    health: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set() and len(health) < 1000:
                start = time.monotonic()
                assert client.get(f"{c.url}/health").status_code == 200
                health.append(time.monotonic() - start)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        for path in ("/v1/chat/completions", "/v1/messages"):
            start = time.monotonic()
            with contextlib.suppress(httpx.WriteError):  # the router may close before the body is sent
                r = httpx.post(
                    f"{c.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30
                )
                assert r.status_code == 413, r.text
                assert "limit is 8388608 bytes" in r.text
            assert time.monotonic() - start < 1.0
        # without a Content-Length: refused once the limit is passed, not read to the end
        chunks = (b"[" + b"1," * (1 << 19) for _ in range(64))
        start = time.monotonic()
        with contextlib.suppress(httpx.WriteError, httpx.RemoteProtocolError):
            r = httpx.post(f"{c.url}/v1/chat/completions", content=chunks, timeout=30)
            assert r.status_code == 413, r.text
        assert time.monotonic() - start < 5.0
    finally:
        stop.set()
        poller.join(timeout=10)
    # the router's event loop was never held up (45 s before the guard); the bound leaves room for a
    # busy test host, where this test process itself shares the cores with the router
    assert len(health) >= 5 and max(health) < 0.25, sorted(health)[-5:]
    assert _rss_mb(pid) < before_mb + 100
    assert len(worker.received) == seen  # nothing was forwarded


def test_deep_nesting_and_lone_surrogates_are_a_400_in_the_apis_shape(routed) -> None:
    c, worker, _ = routed
    seen = len(worker.received)
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    surrogate = b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800"}]}'
    for path in ("/v1/chat/completions", "/v1/messages"):
        for raw in (deep, surrogate):
            r = httpx.post(
                f"{c.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30
            )
            assert r.status_code == 400, r.text
            if path == "/v1/messages":
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            else:
                assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{c.url}/v1/chat/completions", content=surrogate, headers={"content-type": "application/json"}
    )
    assert r.json()["error"]["param"] == "messages[0].content"
    assert (
        "nests too deeply"
        in httpx.post(f"{c.url}/v1/chat/completions", content=deep).json()["error"]["message"]
    )
    assert len(worker.received) == seen


def test_a_clients_kv_transfer_and_credentials_never_reach_a_worker(routed) -> None:
    c, worker, _ = routed
    seen = len(worker.received)
    order = {"handoff_id": "pinned", "deadline_unix": 1e12, "lease_s": 1e9}
    r = httpx.post(f"{c.url}/v1/chat/completions", json={**CHAT, "kv_transfer": order}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer", r.text
    assert len(worker.received) == seen
    credentials = {"authorization": "Bearer client-key", "x-api-key": "client-key",
                   "x-deepinfer-cluster-key": "forged"}  # fmt: skip
    r = httpx.post(f"{c.url}/v1/chat/completions", json=CHAT, headers=credentials, timeout=30)
    assert r.status_code == 200, r.text
    forwarded = worker.received[-1]["headers"]
    assert "authorization" not in forwarded and "x-api-key" not in forwarded
    assert forwarded.get("x-deepinfer-cluster-key") != "forged"


def test_streams_are_counted_by_how_they_ended(routed) -> None:
    c, worker, _ = routed
    for api, path in (("chat", "/v1/chat/completions"), ("messages", "/v1/messages")):
        counts = {o: requests_total(c, api, o) for o in ("ok", "error", "cancelled")}
        mid_stream = c.metric('deepinfer_router_failures_total{kind="mid_stream"}')
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", f"{c.url}{path}", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert (b"message_stop" if api == "messages" else b"[DONE]") in r.read()
        worker.break_after = 2
        try:
            with httpx.stream("POST", f"{c.url}{path}", json=body, timeout=30) as r:
                text = r.read().decode()
        finally:
            worker.break_after = None
        assert "failed mid-stream" in text and "two" in text  # the output so far, then the error event
        c.wait_for(
            lambda: c.health()["status"] == "ok", what="the worker re-admitted"
        )  # ejected when it broke
        worker.delay_s = 0.5
        try:
            with httpx.stream("POST", f"{c.url}{path}", json=body, timeout=30) as r:
                assert r.status_code == 200
                next(r.iter_raw())  # the client leaves after the first output, seconds before the end
        finally:
            worker.delay_s = 0.0
        expected = {
            "ok": counts["ok"] + 1,
            "error": counts["error"] + 1,
            "cancelled": counts["cancelled"] + 1,
        }
        deadline = time.monotonic() + 10
        while {o: requests_total(c, api, o) for o in expected} != expected and time.monotonic() < deadline:
            time.sleep(0.05)  # the left stream is counted once the router sees the client gone
        assert {o: requests_total(c, api, o) for o in expected} == expected
        assert c.metric('deepinfer_router_failures_total{kind="mid_stream"}') == mid_stream + 1
