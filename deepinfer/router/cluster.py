"""``deepinfer cluster``: a local cluster on loopback, for development, tests and benchmarks.

Each worker is its own ``deepinfer serve --role ...`` process (an operator sees its PID and can
signal it), in its own process group, with its output in a log file; it also gets SIGTERM if the
cluster process dies (Linux ``PR_SET_PDEATHSIG``), so workers are never orphaned. Once every worker
answers ``/health``, the router runs in this process on the given port. Ctrl-C or SIGTERM stops the
router, then each worker: SIGTERM to its group, a bounded wait, SIGKILL, wait.

The KV store path is checked (a writable directory, created if missing) and given to every worker
as its shared KV tier (``--kv-shared-path``): prefill workers hand prompts' KV blocks to decode
workers through it (``deepinfer.server.kv_transfer``).

Credentials travel in the environment, never on a command line (which every local user can read):
each worker gets the run's cluster secret (``DEEPINFER_CLUSTER_SECRET``, made per run by the command
line), so only this router can give it handoff orders, release leases or read its load, and the
router's API key (``DEEPINFER_API_KEY``, none if the router has none), so a client that reaches a
worker directly needs the key too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer.logger import get_logger

logger = get_logger(__name__)
LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class WorkerProcess:
    role: str
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


def check_store_path(path: str) -> Path:
    """The KV store directory: created if missing, must be writable (``ValueError`` naming
    ``--kv-store-path`` otherwise)."""
    store = Path(path)
    try:
        store.mkdir(parents=True, exist_ok=True)
        probe = store / f".deepinfer-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--kv-store-path: {path} is not a writable directory ({exc.strerror})") from None
    return store


def start_worker(
    role: str,
    model: str | None,
    serve_args: Sequence[str],
    log_dir: Path,
    threads: int | None,
    index: int,
    environ: Mapping[str, str | None] | None = None,
) -> WorkerProcess:
    """Start one ``deepinfer serve --role role`` on a free loopback port; ``environ``: variables to
    set (``None``: to remove) in its environment, this process's otherwise."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--role", role, "--host", LOOPBACK, "--port", str(port),
           "--log-level", "warning", *(["--model", model] if model else []), *serve_args]  # fmt: skip
    env = dict(os.environ)
    for name, value in (environ or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log = log_dir / f"{role}-{index}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )  # fmt: skip
    return WorkerProcess(role, f"http://{LOOPBACK}:{port}", process, log)


def stop_workers(workers: Sequence[WorkerProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every worker's process group, wait up to ``grace_s``, SIGKILL the rest, reap all."""
    for w in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.process.pid, signal.SIGKILL)
            w.process.wait()
        with contextlib.suppress(ProcessLookupError):  # anything the worker left in its group
            os.killpg(w.process.pid, signal.SIGKILL)


def wait_healthy(workers: Sequence[WorkerProcess], timeout_s: float) -> None:
    """Block until every worker answers ``/health`` with 200; ``RuntimeError`` (with the worker's log
    tail) if one exits first, ``TimeoutError`` after ``timeout_s``."""
    import httpx

    pending = list(workers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for w in list(pending):
            if w.process.poll() is not None:
                raise RuntimeError(
                    f"the {w.role} worker at {w.url} exited ({w.process.returncode}) while starting:\n{w.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{w.url}/health", timeout=2).status_code == 200:
                    pending.remove(w)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"workers not healthy after {timeout_s:.0f} s: {', '.join(w.url for w in pending)}"
            )
        if pending:
            time.sleep(0.25)


@contextlib.contextmanager
def workers_running(
    counts: dict[str, int],
    model: str | None,
    serve_args: Sequence[str] = (),
    threads: int | None = None,
    log_dir: Path | None = None,
    startup_timeout_s: float = 300.0,
    environ: Mapping[str, str | None] | None = None,
) -> Iterator[list[WorkerProcess]]:
    """Start ``counts[role]`` workers of each role, wait until all are healthy, yield them; stop them
    all on exit, however it is left. Their logs go to ``log_dir`` (created if missing, kept), or to a
    temporary directory removed once the workers are stopped (errors raised here carry the log's tail).
    ``environ``: as :func:`start_worker`'s."""
    own_dir = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-cluster-")) if log_dir is None else log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    workers: list[WorkerProcess] = []
    try:
        for role, n in counts.items():
            for i in range(n):
                workers.append(start_worker(role, model, serve_args, log_dir, threads, i, environ))
        wait_healthy(workers, startup_timeout_s)
        yield workers
    finally:
        stop_workers(workers)
        if own_dir:
            shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def cli_process(
    args: Sequence[str],
    log: Path,
    what: str,
    ready_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """``deepinfer <args> --port <free port>`` (``serve``, ``router`` or ``cluster``) as a child
    process (its own session; SIGTERM if this process dies; ``env``: its environment, default this
    process's), stdout and stderr in ``log``. Yields its loopback URL once ``/health`` says ``ok``; on
    exit SIGTERM, then after 60 s SIGKILL of its process group. Raises if it exits or is not healthy
    within ``ready_s``, naming ``what`` with the log's tail."""
    import httpx  # the caller's side only: the engine path never imports an HTTP client

    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", *args, "--port", str(port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            env=None if env is None else dict(env),
        )  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited ({process.returncode}):\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(f"{url}/health", timeout=2).json()["status"] == "ok":
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} was not healthy in {ready_s:g} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_cluster(
    counts: dict[str, int],
    model: str | None,
    serve_args: Sequence[str],
    threads: int | None,
    router_config,
    serve_router: Callable[..., None],
    log_dir: Path | None = None,
) -> int:
    """Start the workers, then the router on ``router_config.port`` until Ctrl-C / SIGTERM
    (``serve_router(config)`` runs it: passed in by the command line, which owns the router's start).
    The workers get the router's cluster secret and API key in their environment. Worker logs:
    ``log_dir`` (kept), else a temporary directory removed at exit."""
    from deepinfer.web.auth import CLUSTER_SECRET_ENV

    environ = {CLUSTER_SECRET_ENV: router_config.cluster_secret, "DEEPINFER_API_KEY": router_config.api_key}
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # startup is interruptible too
    try:
        with workers_running(counts, model, serve_args, threads, log_dir, environ=environ) as workers:
            for w in workers:
                print(
                    f"deepinfer cluster: {w.role} worker pid {w.process.pid} at {w.url} (log {w.log})",
                    flush=True,
                )
            urls = {role: tuple(w.url for w in workers if w.role == role) for role in counts}
            config = router_config.model_copy(update={**urls, "accept_registrations": False})
            # uvicorn handles SIGTERM while it runs, then restores this handler and re-raises it
            print(f"deepinfer cluster: router at http://{config.host}:{config.port}", flush=True)
            serve_router(config)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"deepinfer cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
