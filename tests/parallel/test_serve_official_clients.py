"""The official-client server suite against two data-parallel, expert-parallel ranks.

The test functions of tests/server's OpenAI, Anthropic and bad-input modules (the official ``openai``
and ``anthropic`` clients against the real API front) run unchanged here, over the server a
``deepinfer serve --data-parallel-size 2 --enable-expert-parallel`` runs: the same front code
(``serve_http``, tests/server's conftest), an ``EngineClient`` with two engine cores, each a real
rank process of one gloo group on loopback whose model is expert-parallel (``scripted_rank``: the
production core process with the runner scripted, since these tests script the model's outputs).
The ranks are stopped through the front and, if any is left, killed by PID; none may survive.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from deepinfer.config import EngineConfig
from deepinfer.core.client import EngineClient
from deepinfer.core.launch import CoreSpec
from deepinfer.server.config import ServerConfig
from deepinfer.tokenizer import Tokenizer
from tests.parallel.scripted_rank import ScriptedRankProcess, ScriptFiles
from tests.server import test_anthropic_api, test_bad_input, test_openai_api
from tests.server.conftest import MODEL_NAME, ServerHandle, deepseek_model, serve_http  # noqa: F401
from tests.server.serve_process import alive

pytestmark = pytest.mark.slow

for _module in (test_openai_api, test_anthropic_api, test_bad_input):  # the same test functions
    globals().update({name: f for name, f in vars(_module).items() if name.startswith("test_")})
recipe = test_openai_api.recipe


@pytest.fixture(scope="module")
def server(deepseek_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = EngineConfig(
        model=str(deepseek_model),
        num_kv_blocks=256,
        max_model_len=1024,
        max_num_seqs=64,
        detokenize=False,
        data_parallel_size=2,
        enable_expert_parallel=True,
        master_port=port,
        dp_timeout_s=60,
    )
    scripts = tmp_path_factory.mktemp("scripts")
    tokenizer = Tokenizer(deepseek_model)
    config = ServerConfig(served_model_name=MODEL_NAME, port=0, max_request_bytes=1 << 20)
    ranks: list[ScriptedRankProcess] = []

    def launch(engine_id: int, address: str) -> ScriptedRankProcess:
        spec = CoreSpec(engine_id=engine_id, address=address, parent_pid=os.getpid(), engine=engine)
        ranks.append(ScriptedRankProcess(spec, scripts))
        return ranks[-1]

    client = EngineClient(launch, tokenizer, config.max_queued_requests, num_cores=2)
    try:
        for app, url in serve_http(client, config, tokenizer, start_timeout=300):
            info = client.info
            assert sorted(client.core_pids()) == [0, 1]
            facts = SimpleNamespace(
                tokenizer=tokenizer, cache_spec=SimpleNamespace(block_size=info.block_size)
            )
            yield ServerHandle(url, facts, ScriptFiles(scripts, tokenizer), app, config)
    finally:
        deadline = time.monotonic() + 30
        while any(alive(r.pid) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [r.pid for r in ranks if alive(r.pid)]
        for r in ranks:
            r.kill()
        assert not left, f"rank processes {left} outlived the front"


@pytest.fixture(scope="module")
def openai_client(server: ServerHandle):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def anthropic_client(server: ServerHandle):
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def rank_series(url: str) -> dict[str, dict[str, float]]:
    """``/metrics``' ``deepinfer_dp_rank_*`` samples: series name -> rank -> value."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("deepinfer_dp_rank_"):
            name, rest = line.split("{", 1)
            rank = rest.split('rank="', 1)[1].split('"', 1)[0]
            out.setdefault(name, {})[rank] = float(line.split()[-1])
    return out


def test_metrics_show_each_ranks_load(server: ServerHandle, openai_client) -> None:
    """Four long requests at once: the front spreads them two per rank (fewest active requests), and
    /metrics shows each rank's running requests, KV usage and the tokens its experts computed."""
    server.wait_idle(60)
    release = threading.Event()

    def generate(i: int) -> None:
        stream = openai_client.completions.create(
            model=MODEL_NAME,
            prompt=f"rank load {i}",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with stream:
            for _ in stream:
                if release.is_set():
                    break

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            series = rank_series(server.url)
            if series.get("deepinfer_dp_rank_num_requests_running") == {"0": 2.0, "1": 2.0}:
                break
            time.sleep(0.2)
        assert series["deepinfer_dp_rank_num_requests_running"] == {"0": 2.0, "1": 2.0}, series
        assert set(series["deepinfer_dp_rank_num_requests_waiting"]) == {"0", "1"}
        usage = series["deepinfer_dp_rank_kv_cache_usage_ratio"]
        assert set(usage) == {"0", "1"} and all(0 < u < 1 for u in usage.values()), usage
        experts = series["deepinfer_dp_rank_expert_tokens_per_step"]
        assert set(experts) == {"0", "1"} and all(e > 0 for e in experts.values()), experts
    finally:
        release.set()
        for t in threads:
            t.join(120)
    server.wait_idle(60)
