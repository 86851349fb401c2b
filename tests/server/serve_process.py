"""``deepinfer serve`` as a real process tree for the tests (front + engine-core process), on a
free loopback port; every process is stopped by its PID, and the tests check none is left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from deepinfer.server.launch import bind
from tests.conftest import REPO_ROOT

SMALL_KV = ["--kv-cache-memory-gib", "0.05", "--max-model-len", "1024"]


def free_port() -> int:
    with contextlib.closing(bind("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(") ", 1)[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(name))
    return members


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited: count it as gone
    except OSError:
        return True


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    log: Path

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=2)

    def core_pid(self) -> int:
        return int(self.health().json()["engine_cores"]["0"])

    def wait_healthy(self, timeout: float) -> float:
        """Wait until /health is 200; returns the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"deepinfer serve exited ({self.proc.returncode}):\n{self.output[-3000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if self.health().status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"deepinfer serve not healthy after {timeout} s:\n{self.output[-3000:]}")


@contextlib.contextmanager
def serve(
    model: Path, *args: str, name: str = "tiny", timeout: float = 90, new_session: bool = False
) -> Iterator[Served]:
    """Start ``deepinfer serve`` and wait until healthy; on exit, SIGKILL whatever is left (front and
    core, by PID) and assert nothing survives. ``new_session``: in a session and process group of
    its own (its group id is its PID), as a service manager starts it."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="deepinfer-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "deepinfer.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--served-model-name", name, *SMALL_KV, *args]
    env = {**os.environ, "DEEPINFER_MALLOC_TUNING": "0", "DEEPINFER_ACCELERATOR": "cpu"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
    served = Served(proc, f"http://127.0.0.1:{port}", log)
    cores: set[int] = set()
    try:
        served.wait_healthy(timeout)
        cores.add(served.core_pid())
        yield served
    finally:
        with contextlib.suppress(Exception):
            cores.add(served.core_pid())
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in cores) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in cores if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        log.unlink(missing_ok=True)
        assert not left, f"engine core processes {left} outlived their front"


def sse_events(lines: list[str]) -> list[dict | str]:
    """The ``data:`` payloads of an SSE stream (JSON decoded; ``[DONE]`` as the string)."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
