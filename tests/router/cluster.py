"""A real ``deepinfer cluster`` for the tests: worker processes plus the router, on loopback."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deepinfer.router.cluster import cli_process


@dataclass
class Cluster:
    url: str
    log: Path
    workers: dict[str, dict] = field(default_factory=dict)  # url -> {"role", "pid"}

    def workers_of(self, role: str) -> list[str]:
        return [u for u, w in self.workers.items() if w["role"] == role]

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout} s; router health {self.health()}")
            time.sleep(0.1)

    def metric(self, series: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(series + " ") or (
                line.startswith(series + "{") and line.split(" ")[0] == series
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    return True


@contextlib.contextmanager
def running_cluster(tmp_path: Path, *args: str, timeout_s: float = 180.0) -> Iterator[Cluster]:
    """``deepinfer cluster ARGS`` with 1-thread workers; yields once the router's /health is ok;
    stops it with SIGTERM and checks that no worker outlives it and that it left no file in its
    temporary directory (its processes' ``TMPDIR``)."""
    log = tmp_path / "cluster.log"
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    args = ("--kv-store-path", str(tmp_path / "store"), "--worker-threads", "1", "--worker-kv-cache-gib", "0.25",
            "--log-level", "warning", *args)  # fmt: skip
    # the reference CPU ops: these tests are about routing, and starting many workers at once must not
    # wait on (or, killed mid-start, leave behind) a lock on the shared build of the native kernels
    env = {**os.environ, "DEEPINFER_CPU_BACKEND": "reference", "TMPDIR": str(scratch)}
    workers: dict[str, dict] = {}
    try:
        with cli_process(("cluster", *args), log, "deepinfer cluster", timeout_s, env) as url:
            for m in re.finditer(r"(\w+) worker pid (\d+) at (\S+)", log.read_text()):
                workers[m.group(3)] = {"role": m.group(1), "pid": int(m.group(2))}
            yield Cluster(url, log, workers)
    finally:
        for w in workers.values():  # stop_workers reaped them: none may be left
            deadline = time.monotonic() + 10
            while _alive(w["pid"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(w["pid"]):
                os.kill(w["pid"], signal.SIGKILL)
                raise AssertionError(f"worker pid {w['pid']} outlived the cluster")
    left = sorted(p.name for p in scratch.iterdir())
    assert not left, f"the cluster left {left} in its TMPDIR"


@contextlib.contextmanager
def plain_server(tmp_path: Path, timeout_s: float = 180.0) -> Iterator[str]:
    """One ``deepinfer serve`` without a KV store (the reference a cluster must match), with the
    cluster workers' settings (1 thread, the reference CPU ops); yields its URL, stops it by PID."""
    from unittest import mock

    from deepinfer.router.cluster import start_worker, stop_workers, wait_healthy

    with mock.patch.dict(os.environ, {"DEEPINFER_CPU_BACKEND": "reference"}):
        worker = start_worker("both", None, ["--kv-cache-memory-gib", "0.25"], tmp_path, 1, 99)
    try:
        wait_healthy([worker], timeout_s)
        yield worker.url
    finally:
        stop_workers([worker])
        assert worker.process.poll() is not None


def pid_serving(url: str) -> int:
    """The PID of the ``deepinfer`` process started with ``--port`` of ``url`` (found in /proc)."""
    port = url.rsplit(":", 1)[1].encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"deepinfer.cli" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
                    return int(entry.name)
    raise AssertionError(f"no deepinfer process serves {url}")


def environment_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return {k.decode(): v.decode(errors="replace") for k, _, v in (e.partition(b"=") for e in entries) if k}


def cluster_secret(c: Cluster) -> str:
    """The cluster's secret, read from a worker's environment (``deepinfer cluster`` hands it to
    every worker that way, never on the command line)."""
    from deepinfer.web.auth import CLUSTER_SECRET_ENV

    return environment_of(next(iter(c.workers.values()))["pid"])[CLUSTER_SECRET_ENV]


def worker_load(url: str) -> dict:
    """The load report of the worker at ``url``, asked as its router asks: with the cluster key
    when the worker holds a cluster secret (read from its environment)."""
    from deepinfer.web.auth import CLUSTER_KEY_HEADER, CLUSTER_SECRET_ENV

    secret = environment_of(pid_serving(url)).get(CLUSTER_SECRET_ENV)
    headers = {CLUSTER_KEY_HEADER: secret} if secret else None
    response = httpx.get(f"{url}/load", headers=headers, timeout=5)
    response.raise_for_status()
    return response.json()


def worker_metric(url: str, series: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.split(" ")[0] == series:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no {series}")
