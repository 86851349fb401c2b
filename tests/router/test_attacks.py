"""Issue 34's acceptance: the attack reproductions against a real ``deepinfer cluster --prefill 1
--decode 1 --kv-store-path P --api-key K``:

- a rogue registration is refused, and the rogue URL (a loopback listener) is never contacted;
- every route that changes or reveals state answers 401/403 without a key, on the router and on
  each worker (``/v1/*``, ``/router/workers``, ``/load``, ``/kv/release``, ``/router/register``);
  only the cluster key opens a worker's router-only routes, the API key does not;
- the cluster's secret and API key reach the workers through their environment, never argv;
- a 64 MB body is refused (413) in under 1 s, the router's RSS staying under 300 MB, while
  ``/health`` keeps answering within 100 ms;
- deep JSON nesting and lone surrogates are a 400, a client's ``kv_transfer`` is refused;
- nothing answers 5xx.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepinfer.web.auth import CLUSTER_KEY_HEADER, CLUSTER_SECRET_ENV
from tests.router.cluster import Cluster, cluster_secret, environment_of, pid_serving, running_cluster
from tests.router.test_trust import Listener

KEY = "attack-test-client-key"
MODEL = "deepinfer-tiny-coder"
JSON = {"content-type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": CHAT,
    "/v1/messages/count_tokens": {"model": MODEL, "messages": CHAT["messages"]},
}
READS = ("/v1/models", f"/v1/models/{MODEL}", "/docs", "/openapi.json")
pytestmark = pytest.mark.slow
# /health latency, measured from a process of its own (in this one, the attacker's 64 MB writes would
# hold the GIL and time this process, not the router): polls until SIGINT or argv[2] seconds, prints
# the latencies as JSON
HEALTH_POLLER = """
import json, sys, time, httpx
url, seconds, out = sys.argv[1], float(sys.argv[2]), []
with httpx.Client(timeout=5) as client:
    client.get(url + "/health").raise_for_status()
    end = time.monotonic() + seconds
    try:
        print("polling", flush=True)
        while time.monotonic() < end and len(out) < 100000:
            t = time.monotonic()
            client.get(url + "/health").raise_for_status()
            out.append(time.monotonic() - t)
            time.sleep(0.005)
    except KeyboardInterrupt:
        pass
print(json.dumps(out))
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


class Attacker:
    """An HTTP client that records every status it was answered (none may be a 5xx)."""

    def __init__(self) -> None:
        self.client = httpx.Client(timeout=30)
        self.seen: list[tuple[str, str, int]] = []

    def __call__(self, method: str, url: str, **kwargs) -> httpx.Response:
        r = self.client.request(method, url, **kwargs)
        self.seen.append((method, url, r.status_code))
        return r


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("attacks")
    with running_cluster(tmp, "--prefill", "1", "--decode", "1", "--api-key", KEY, timeout_s=120) as c:
        yield c


def test_the_attacks_of_issue_34_fail(cluster: Cluster) -> None:
    c, ask = cluster, Attacker()
    started = time.monotonic()
    secret = cluster_secret(c)
    keyed = {"Authorization": f"Bearer {KEY}"}

    # the credentials travel in the environment: no local user reads them off a command line
    for url, worker in c.workers.items():
        argv = Path(f"/proc/{worker['pid']}/cmdline").read_bytes()
        assert secret.encode() not in argv and KEY.encode() not in argv, url
        env = environment_of(worker["pid"])
        assert env[CLUSTER_SECRET_ENV] == secret and env["DEEPINFER_API_KEY"] == KEY

    # rogue registration: refused, whatever key it offers, and its URL never contacted
    with Listener() as rogue:
        for headers in ({}, {CLUSTER_KEY_HEADER: "forged-forged-forged-forged"}, keyed):
            for path in ("/router/register", "/router/deregister"):
                r = ask("POST", f"{c.url}{path}", json={"url": rogue.url}, headers=headers)
                assert r.status_code == 403, (path, r.text)
        time.sleep(0.5)
        assert rogue.connections == 0
    assert rogue.url not in c.health()["workers"]

    # without a key: 401 on everything that reveals or changes state, router and workers alike
    for base in (c.url, *c.workers):
        for path, body in BODIES.items():
            for headers in ({}, {"x-api-key": "wrong"}, {CLUSTER_KEY_HEADER: "forged-forged-forged-forged"}):
                r = ask("POST", f"{base}{path}", json=body, headers=headers)
                assert r.status_code == 401, (base, path, r.text)
                shape = r.json()["error"]["type"]
                assert shape == "authentication_error" and (r.json().get("type") == "error") == (
                    path.startswith("/v1/messages")
                )
        for path in READS:
            assert ask("GET", f"{base}{path}").status_code == 401, (base, path)
    assert ask("GET", f"{c.url}/router/workers").status_code == 401
    for worker in c.workers:
        for headers in ({}, keyed):  # the API key does not open a worker's router-only routes
            load = ask("GET", f"{worker}/load", headers=headers)
            release = ask("POST", f"{worker}/kv/release", json={"handoff_id": "x"}, headers=headers)
            assert load.status_code == release.status_code == (403 if headers else 401), (worker, load.text)
        assert ask("GET", f"{worker}/load", headers={CLUSTER_KEY_HEADER: secret}).status_code == 200
        order = {"handoff_id": "pinned", "deadline_unix": 1e12, "lease_s": 1e9}
        pinned = ask(
            "POST", f"{worker}/v1/chat/completions", json={**CHAT, "kv_transfer": order}, headers=keyed
        )
        assert pinned.status_code == 403 and pinned.json()["error"]["param"] == "kv_transfer"

    # with the key, through the router: the router talks to the workers with the cluster key
    models = ask("GET", f"{c.url}/v1/models", headers=keyed)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL]
    assert ask("GET", f"{c.url}/router/workers", headers=keyed).status_code == 200
    answer = ask("POST", f"{c.url}/v1/chat/completions", json=CHAT, headers=keyed)
    assert answer.status_code == 200, answer.text
    pinned = ask(
        "POST", f"{c.url}/v1/chat/completions", json={**CHAT, "kv_transfer": {"lease_s": 1e9}}, headers=keyed
    )
    assert pinned.status_code == 400 and pinned.json()["error"]["param"] == "kv_transfer"

    # malformed bodies: a 400 in the API's shape, at the router and at a worker
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    surrogate = b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800"}]}'
    for base in (c.url, c.workers_of("decode")[0]):
        for path in ("/v1/chat/completions", "/v1/messages"):
            for raw in (deep, surrogate):
                r = ask("POST", f"{base}{path}", content=raw, headers={**JSON, **keyed})
                assert r.status_code == 400, (base, path, r.text[:300])

    # a 64 MB body: refused at once, the router's memory and /health unaffected
    router_pid = pid_serving(c.url)  # deepinfer cluster runs the router in its own process
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (64 << 20) + b'"}]}'
    poller = subprocess.Popen(
        [sys.executable, "-c", HEALTH_POLLER, c.url, "30"], stdout=subprocess.PIPE, text=True
    )
    peak = 0.0
    try:
        assert poller.stdout is not None and poller.stdout.readline() == "polling\n"
        time.sleep(0.2)
        for path in ("/v1/chat/completions", "/v1/messages"):
            for headers in (keyed, {}):
                t = time.monotonic()
                with contextlib.suppress(httpx.WriteError):  # the router may close before it is all sent
                    r = ask("POST", f"{c.url}{path}", content=body, headers={**JSON, **headers})
                    assert r.status_code == (413 if headers else 401), r.text[:300]
                assert time.monotonic() - t < 1.0
                peak = max(peak, rss_mb(router_pid))
        chunks = (b"[" + b"1," * (1 << 19) for _ in range(64))  # 64 MB without a Content-Length
        t = time.monotonic()
        with contextlib.suppress(httpx.WriteError, httpx.RemoteProtocolError):
            r = ask("POST", f"{c.url}/v1/chat/completions", content=chunks, headers=keyed)
            assert r.status_code == 413, r.text[:300]
        assert time.monotonic() - t < 1.0
        peak = max(peak, rss_mb(router_pid))
        poller.send_signal(signal.SIGINT)  # ends its loop: it prints what it measured
        health = json.loads(poller.communicate(timeout=30)[0])
    finally:
        if poller.poll() is None:
            poller.kill()
            poller.wait()
    refused = sum(s[2] == 413 for s in ask.seen)
    print(f"64 MB bodies: {refused} answered 413; router RSS peak {peak:.0f} MB; /health from another process "
          f"median {statistics.median(health) * 1e3:.1f} ms, max {max(health) * 1e3:.1f} ms over {len(health)}")  # fmt: skip
    assert refused >= 2, ask.seen[-5:]  # each API's; a refused 64 MB write may end in a WriteError instead
    assert peak < 300, f"router RSS {peak:.0f} MB"
    assert len(health) >= 20 and max(health) < 0.1, sorted(health)[-5:]

    errors = [s for s in ask.seen if s[2] >= 500]
    assert not errors, errors
    assert c.health()["status"] == "ok"
    assert time.monotonic() - started < 60
