"""The benchmark tools on a tiny model: the JSON they promise, the plot, and a real peer run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deepinfer import LLM
from deepinfer.bench.corpus import heldout_files, is_heldout
from deepinfer.bench.pareto import sweep, write
from deepinfer.bench.peer import agreement
from deepinfer.bench.workload import Workload
from tests.conftest import REPO_ROOT

SMALL = ["--num-requests", "4", "--input-len-range", "8", "24", "--output-len", "6", "--threads", "1"]


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu", "DEEPINFER_LOG_LEVEL": "WARNING"}
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "bench", *args], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_heldout_split_is_stable_and_small() -> None:
    files = heldout_files()
    assert files and all(is_heldout(path) for path, _ in files)
    assert is_heldout(files[0][0]) == is_heldout(files[0][0])


def test_workload_is_seeded(tiny_model: Path) -> None:
    tok = LLM(str(tiny_model), num_kv_blocks=32).get_tokenizer()
    a = Workload(5, (10, 30), 4, seed=3).prompts(tok)
    assert a == Workload(5, (10, 30), 4, seed=3).prompts(tok)
    assert a != Workload(5, (10, 30), 4, seed=4).prompts(tok)
    assert all(10 <= len(p) <= 30 for p in a)


def test_offline_json_has_the_promised_fields(tiny_model: Path) -> None:
    proc = bench("offline", "--model", str(tiny_model), "--json", *SMALL)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in ("requests", "output_tokens", "output_tokens_per_s", "mean_ttft_s", "p99_step_s",
                "draft_tokens", "verified_tokens", "accepted_tokens", "mean_accepted_len"):  # fmt: skip
        assert key in result, key
    assert result["requests"] == 4 and result["output_tokens"] == 24
    # the warm-up leaves nothing of the measured prompts in the prefix cache (it once ran them whole)
    assert result["cached_prompt_tokens"] == 0
    assert result["env"]["platform"] == "cpu" and result["env"]["git_commit"]


def test_pareto_writes_json_and_png(tiny_model: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    result = sweep(llm, Workload(4, (8, 16), 5, seed=0), [1, 2, 4])
    assert [p["concurrency"] for p in result["points"]] == [1, 2, 4]
    write(result, tmp_path / "pareto")
    assert json.loads((tmp_path / "pareto.json").read_text())["points"]
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_peer_comparison_against_transformers(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    proc = bench(
        "peer", "--model", str(tiny_model), "--peer", "transformers", "--reps", "1", "--out", str(out), *SMALL
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["throughput_ratio"] > 0
    assert result["transformers"]["config"]["engine"] == "transformers"
    # float32 greedy on the same weights: the two engines agree token for token
    assert result["greedy_agreement"]["identical_share"] == 1.0


def test_agreement_measure() -> None:
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {
        "identical_share": 0.5,
        "mean_common_prefix": 2.0,
    }


def test_serving_load_generator(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    proc = bench("serve", "--model", str(tiny_model), "--request-rate", "8", "--out", str(out), *SMALL)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == result["requests"] == 4 and not result["errors"]
    assert result["output_tokens"] == 24
    assert 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] < result["e2e_s"]["p99"]
    assert result["tpot_s"]["mean"] > 0 and result["itl_s"]["p99"] > 0
