"""Several hosts, simulated on loopback: two torchrun "nodes" (--nnodes 2 --node-rank 0/1) of one rank
each run deepinfer.parallel.launch; rank 0 writes the outputs, which equal one process's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fib(n):", "import os\\nimport sys\\n", "class Stack:", "for i in range(10):", "x = [1, 2,"]


@pytest.mark.slow
def test_two_nodes_under_torchrun_match_one_process(tmp_path: Path) -> None:
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "DEEPINFER_NUM_THREADS": "1",
        "DEEPINFER_ACCELERATOR": "cpu",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    out = tmp_path / "out.jsonl"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--log-dir",  # torchrun's default is a temporary directory it leaves behind
                str(tmp_path / f"torchrun-{node}"),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "deepinfer.parallel.launch",
                "--file",
                str(prompt_file),
                "--max-tokens",
                "12",
                "--num-kv-blocks",
                "64",
                "--dp-timeout-s",
                "60",
                "--out",
                str(out),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
    ]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(PROMPTS)))
    assert {r["rank"] for r in rows} == {0, 1}
    ref = LLM(num_kv_blocks=64).generate(
        [p.replace("\\n", "\n") for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=12)
    )
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in ref]
