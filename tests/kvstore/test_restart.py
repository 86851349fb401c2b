"""A real ``deepinfer serve`` with a store path, killed with SIGKILL and restarted on the same path:
the same 4,000-token prompt reports its cached tokens and gives the same greedy output."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deepinfer.bench.workload import heldout_stream
from deepinfer.model_zoo import default_model_path
from deepinfer.router.cluster import LOOPBACK, free_port
from deepinfer.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT


def start(store: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--host", LOOPBACK, "--port", str(port),
           "--log-level", "warning", "--max-model-len", "8192", "--kv-store-path", str(store),
           "--kv-host-cache-gib", "0.25"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DEEPINFER_ACCELERATOR": "cpu"}
    with log.open("a") as err:  # a file, not a pipe: nobody reads it while the server runs
        proc = subprocess.Popen(cmd, env=env, stderr=err, stdout=err, start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"deepinfer serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        assert time.monotonic() < deadline, "deepinfer serve did not become healthy"
        time.sleep(0.5)


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the server and everything it started (its session: the engine-core process too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "deepinfer-tiny-coder", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def disk_writes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'^deepinfer_kv_store_writes_total\{tier="disk"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_a_killed_server_restarts_with_its_stored_prefixes(tmp_path: Path) -> None:
    stream = heldout_stream(Tokenizer(default_model_path()))
    prompt = stream[5000:9000]
    proc, url = start(tmp_path / "store", tmp_path / "serve.log")
    try:
        first = complete(url, prompt)
        assert first["usage"]["prompt_tokens"] == 4000
        deadline = time.monotonic() + 60
        while disk_writes(url) < 4000 // 16 - 1:  # every full block durable (write-behind)
            assert time.monotonic() < deadline, "the blocks never reached the disk tier"
            time.sleep(0.2)
    finally:
        kill9(proc)
    proc, url = start(tmp_path / "store", tmp_path / "serve.log")
    try:
        second = complete(url, prompt)
    finally:
        kill9(proc)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3900
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
