"""``deepinfer serve --data-parallel-size 2 --enable-expert-parallel``: two engine cores are two
lockstep ranks; the official OpenAI client gets the same greedy completions as one process, and a
killed rank makes the server exit non-zero. Real processes on loopback, stopped by PID."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model_zoo import default_model_path
from tests.server.serve_process import alive, serve

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(10):"]


@pytest.mark.slow
def test_serve_two_ranks_matches_one_process_and_a_dead_rank_stops_it() -> None:
    openai = pytest.importorskip("openai")
    model = default_model_path()
    ref = LLM(max_model_len=1024, num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16)
    )
    args = ("--data-parallel-size", "2", "--enable-expert-parallel", "--dp-timeout-s", "10")
    with serve(model, *args, timeout=180) as served:
        cores = served.health().json()["engine_cores"]
        assert sorted(cores) == ["0", "1"]
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        texts = [
            client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in PROMPTS
        ]
        assert texts == [o.text for o in ref]
        os.kill(int(cores["1"]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while served.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served.proc.returncode not in (None, 0), served.output[-3000:]
        time.sleep(1)
        assert not alive(int(cores["0"])), "the surviving rank outlived the server"
