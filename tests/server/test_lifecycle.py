"""The server as a program: ``deepinfer serve`` end to end, light imports, an engine failure, and a
client that gives up on a plain (non-streamed) request."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import REPO_ROOT, run_python
from tests.server.conftest import MODEL_NAME, ScriptedRunner, ServerHandle, start_server


def test_the_engine_path_never_imports_the_server_stack() -> None:
    code = (
        "import sys, deepinfer, deepinfer.cli, deepinfer.recipe, deepinfer.engine.llm_engine\n"
        "try:\n    deepinfer.cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('fastapi', 'starlette', 'uvicorn', 'prometheus_client') if m in sys.modules]\n"
        "print('loaded:', bad)\nsys.exit(1 if bad else 0)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--api-key" in proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepinfer_serve_runs_until_interrupted(deepseek_model: Path) -> None:
    port = _free_port()
    env = {**os.environ, "DEEPINFER_MALLOC_TUNING": "0", "DEEPINFER_API_KEY": "k"}
    command = [sys.executable, "-m", "deepinfer.cli", "serve", "--model", str(deepseek_model)]
    command += ["--port", str(port), "--served-model-name", "cli-model", "--max-model-len", "256"]
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            exited = proc.poll() is not None
            assert not exited and time.monotonic() < deadline, proc.stdout.read() if exited else "timeout"
            time.sleep(0.2)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
            assert client.models.list().data[0].id == "cli-model"
            reply = client.chat.completions.create(
                model="cli-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.usage.completion_tokens <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert "model 'cli-model' at http://127.0.0.1:" in output and "auth on" in output  # the banner
    assert "| KV store off" in output
    assert re.search(r"Finished server process", output)


def test_the_banner_says_whether_a_kv_store_is_on_and_where(deepseek_model: Path, tmp_path: Path) -> None:
    from deepinfer.config import EngineConfig
    from deepinfer.kvstore.config import KVStoreConfig
    from deepinfer.server.launch import kv_store_summary

    assert kv_store_summary(EngineConfig(model=str(deepseek_model))) == "off"
    store = KVStoreConfig(
        host_cache_gib=0.5, path=str(tmp_path / "disk"), shared_path=str(tmp_path / "shared")
    )
    summary = kv_store_summary(EngineConfig(model=str(deepseek_model), kv_store=store))
    assert summary == (
        f"on: host memory 0.5 GiB; disk {tmp_path / 'disk'}, 16 GiB; shared {tmp_path / 'shared'}, 64 GiB"
    )
    host_only = kv_store_summary(EngineConfig(model=str(deepseek_model), kv_store=KVStoreConfig()))
    assert host_only == "on: host memory 1 GiB"


class ExplodingRunner(ScriptedRunner):
    """Fails the step in which a request whose prompt mentions "[explode]" would get its fourth token."""

    def execute(self, scheduled):
        if any(
            len(r.output_token_ids) >= 3 and self._explodes(r.prompt_token_ids) for r in scheduled.requests
        ):
            raise RuntimeError("simulated device failure")
        return super().execute(scheduled)

    def _explodes(self, prompt_token_ids: list[int]) -> bool:
        return "[explode]" in self.engine.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def fragile(deepseek_model: Path) -> Iterator[ServerHandle]:
    yield from start_server(deepseek_model, runner=ExplodingRunner)


def test_an_engine_failure_ends_streams_with_an_error_and_health_reports_it(fragile: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "[explode] now"}], "stream": True}
    body |= {"max_tokens": 50, "ignore_eos": True}
    with httpx.stream("POST", f"{fragile.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert '"role":"assistant"' in lines[0] and '"content"' in lines[1]  # tokens flowed, then it failed
    assert '"error"' in lines[-2] and "simulated device failure" in lines[-2] and lines[-1] == "data: [DONE]"
    health = httpx.get(f"{fragile.url}/health")
    assert health.status_code == 503 and "simulated device failure" in health.json()["reason"]
    again = httpx.post(
        f"{fragile.url}/v1/messages",
        json={"model": MODEL_NAME, "max_tokens": 3, "messages": body["messages"]},
    )
    assert again.status_code == 503 and again.json()["error"]["type"] == "api_error"


def test_a_plain_request_abandoned_by_its_client_is_aborted(server: ServerHandle) -> None:
    server.wait_idle()
    aborted = server.metric('deepinfer_requests_total{finish_reason="abort"}')
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "long"}]}
    body |= {"max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.5)
    server.wait_idle(timeout=10)
    assert server.metric('deepinfer_requests_total{finish_reason="abort"}') == aborted + 1
