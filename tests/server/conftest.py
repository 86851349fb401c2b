"""A real server for the tests: a tiny random DeepSeek-V3 checkpoint with a tokenizer that has
DeepSeek's full control-token set, served on a loopback port by the same code as ``deepinfer
serve`` (``deepinfer.server.runner.run``), in a background thread. The engine core speaks the real
channel (ZeroMQ, typed messages) but runs in a thread of the test process (``CoreThread``), so
tests can script its model runner; tests of the process model start ``deepinfer serve`` itself.

Scripting the model (``ScriptedRunner``): a random model writes noise, so tests that need a
particular completion (a tool call, reasoning) script it. The runner of the served engine is
wrapped: the real model still runs every step (KV cache, prefix cache and scheduling are real), then
the sampled token of a request whose prompt contains a registered key is replaced by the script's
next token, and EOS once the script is done. Nothing in the engine knows about it.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from deepinfer.config import EngineConfig
from deepinfer.core.client import EngineClient
from deepinfer.core.launch import CoreThread
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.server.app import build_app
from deepinfer.server.config import ServerConfig
from deepinfer.server.launch import bind
from deepinfer.server.runner import IdleTimeoutH11Protocol, Server, run
from deepinfer.worker.model_runner import RunnerOutput
from tests.model.hf_models import make_hf_checkpoint
from tests.recipe.deepseek_tokenizer import write_deepseek_tokenizer

MODEL_NAME = "tiny-deepseek"


@pytest.fixture(scope="session")
def deepseek_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek")
    vocab = write_deepseek_tokenizer(path)
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer(path)
    make_hf_checkpoint(
        path,
        vocab_size=vocab,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        max_position_embeddings=1024,
    )
    write_deepseek_tokenizer(path)  # save_pretrained leaves tokenizer files alone; rewrite to be sure
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    return path


class ScriptedRunner:
    """Wraps an engine's ``runner.execute``: requests whose prompt text contains a scripted key
    produce that script's tokens, then EOS (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.scripts: dict[str, list[int]] = {}
        self._execute = engine.runner.execute
        engine.runner.execute = self.execute

    def script(self, key: str, output: str) -> list[int]:
        """Requests whose prompt contains ``key`` will generate ``output`` (tokenized with control
        tokens parsed, as the model would emit them) and then EOS. Returns the scripted ids."""
        ids = self.engine.tokenizer.encode(output, add_special_tokens=False)
        self.scripts[key] = ids
        return ids

    def _script_for(self, prompt_token_ids: list[int]) -> list[int] | None:
        text = self.engine.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        matches = [key for key in self.scripts if key in text]
        return self.scripts[max(matches, key=len)] if matches else None

    def execute(self, scheduled):
        result = self._execute(scheduled)
        eos = self.engine.tokenizer.eos_token_id
        for request in scheduled.requests:
            rid = request.request_id
            script = self._script_for(request.prompt_token_ids) if rid in result.sampled else None
            if script is None:
                continue
            position = len(request.output_token_ids)
            token = script[position] if position < len(script) else eos
            result.sampled[rid] = [token]  # one token a step; the model's drafts are dropped
            result.drafts.pop(rid, None)
            if rid in result.logprobs:
                result.logprobs[rid] = [[(token, 0.0, 1)]]
        return result


class NullModel:
    """Replaces an engine's model runner with one that computes nothing: each sampling request gets
    a pseudo-random token (EOS one time in eight). For fuzzing the HTTP layer at full speed."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self._rng = random.Random(seed)
        engine.runner.execute = self.execute

    def execute(self, scheduled) -> RunnerOutput:
        out = RunnerOutput()
        eos, vocab = self.engine.tokenizer.eos_token_id, self.engine.model_config.vocab_size
        for request in scheduled.requests:
            if not request.samples:
                continue
            token = eos if self._rng.random() < 0.125 else self._rng.randrange(vocab)
            out.sampled[request.request_id] = [token]
            k = request.sampling_params.logprobs
            if k is not None:
                out.logprobs[request.request_id] = [
                    [(token, -1.0, 1)] + [(t, -1.0 - t, t + 1) for t in range(k)]
                ]
        return out


@dataclass
class ServerHandle:
    url: str
    engine: LLMEngine
    runner: ScriptedRunner | NullModel
    app: object
    config: ServerConfig

    @property
    def client(self) -> EngineClient:
        return self.app.state.serving.client

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metric(self, series: str) -> float:
        """The current value of one series of ``/metrics`` (0 if absent)."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is in flight and the engine has freed every KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.client.stats
            if (
                self.client.num_in_flight
                == s.num_running
                == s.num_waiting
                == s.num_blocks - s.num_free_blocks
                == 0
            ):
                return
            time.sleep(0.02)
        raise AssertionError(f"server not idle after {timeout}s: {self.client.stats}")


def start_server(
    model: Path, runner=ScriptedRunner, engine: dict | None = None, **config
) -> Iterator[ServerHandle]:
    """Serve ``model`` on 127.0.0.1 (a free port) in a thread; yields a handle, stops on exit.
    ``runner`` wraps the engine's model runner; ``engine``: EngineConfig overrides; ``config``:
    ServerConfig fields."""
    options = {"num_kv_blocks": 256, "max_model_len": 1024, "detokenize": False, **(engine or {})}
    llm_engine = LLMEngine(EngineConfig(model=str(model), **options))
    runner = runner(llm_engine)
    server_config = ServerConfig(served_model_name=MODEL_NAME, port=0, **config)
    client = EngineClient(
        lambda engine_id, address: CoreThread(llm_engine, engine_id, address),
        llm_engine.tokenizer,
        server_config.max_queued_requests,
        request_timeout_s=server_config.request_timeout_s,
    )
    for app, url in serve_http(client, server_config, llm_engine.tokenizer):
        yield ServerHandle(url, llm_engine, runner, app, server_config)


def serve_http(
    client: EngineClient, server_config: ServerConfig, tokenizer, start_timeout: float = 30.0
) -> Iterator[tuple[object, str]]:
    """Run the API front over ``client`` (``deepinfer serve``'s code) on a free loopback port in a
    thread; yields ``(app, url)`` once it accepts requests (its cores started), stops it on exit."""
    app = build_app(client, server_config, tokenizer)
    uv_config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        http=IdleTimeoutH11Protocol,
        timeout_keep_alive=server_config.timeout_keep_alive_s,
    )
    server = Server(uv_config, app.state.serving, server_config.drain_timeout_s)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(
        target=asyncio.run, args=(run(server, client, [sock]),), name="server-test", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def server(deepseek_model: Path) -> Iterator[ServerHandle]:
    yield from start_server(deepseek_model, engine={"max_num_seqs": 64}, max_request_bytes=1 << 20)


@pytest.fixture(scope="session")
def openai_client(server: ServerHandle):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def anthropic_client(server: ServerHandle):
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client
