"""Side-by-side comparison with a peer engine, in one run, on the same model and the same prompts.

Each repetition runs deepinfer and then the peer (A B A B ...), each in a fresh process with the same
thread count and malloc settings; the report gives medians, the throughput ratio, the machine's load
during each run, and how often the greedy outputs agree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from deepinfer.bench.report import git_commit
from deepinfer.bench.workload import Workload
from deepinfer.malloc_tuning import MALLOC_TUNABLES
from deepinfer.tokenizer import Tokenizer

DRIVERS = {
    "deepinfer": "deepinfer.bench.peers.deepinfer_driver",
    "transformers": "deepinfer.bench.peers.hf_transformers",
    "vllm": "deepinfer.bench.peers.vllm_cpu",
    "llamacpp": "deepinfer.bench.peers.llama_cpp",
}


def _run(driver: str, python: str, job: Path, threads: int) -> dict:
    result = job.with_suffix(f".{driver.rsplit('.', 1)[-1]}.json")
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES, "OMP_NUM_THREADS": str(threads)}
    src = str(Path(__file__).resolve().parents[1].parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    # vllm-cpu links Intel OpenMP; without preloading it the engine's worker process fails to start.
    iomp = Path(python).absolute().parents[1] / "lib" / "libiomp5.so"
    if driver == DRIVERS["vllm"] and iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    load_before = os.getloadavg()[0]
    proc = subprocess.run(
        [python, "-m", driver, str(job), str(result)], env=env, capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{driver} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(result.read_text())
    out["load_average_before"] = load_before
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of identical greedy outputs and the mean length of their common prefixes."""
    same, prefixes = 0, []
    for x, y in zip(a, b):
        same += x == y
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefixes.append(n)
    return {"identical_share": same / len(a), "mean_common_prefix": statistics.fmean(prefixes)}


def compare(
    model: str,
    workload: Workload,
    peer: str,
    peer_python: str,
    reps: int,
    threads: int,
    engine_options: dict,
    peer_model: str | None = None,
) -> dict:
    """``peer_model``: what the peer loads when it is not the checkpoint folder (llama.cpp's .gguf)."""
    if peer not in DRIVERS or peer == "deepinfer":
        raise ValueError(
            f"unknown peer {peer!r}; choose one of: {', '.join(k for k in DRIVERS if k != 'deepinfer')}"
        )
    prompts = workload.prompts(Tokenizer(model))
    runs: dict[str, list[dict]] = {"deepinfer": [], peer: []}
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "ours.json", Path(tmp) / "peer.json"
        common = {"prompts": prompts, "output_len": workload.output_len, "threads": threads}
        ours.write_text(json.dumps({**common, "model": model, "engine_options": engine_options}))
        theirs.write_text(json.dumps({**common, "model": peer_model or model}))
        for _ in range(reps):
            runs["deepinfer"].append(_run(DRIVERS["deepinfer"], sys.executable, ours, threads))
            runs[peer].append(_run(DRIVERS[peer], peer_python, theirs, threads))

    def summary(name: str) -> dict:
        rs = runs[name]
        tps = [r["output_tokens"] / r["wall_s"] for r in rs]
        return {"output_tokens_per_s": statistics.median(tps), "reps": tps, "wall_s": [r["wall_s"] for r in rs],
                "load_average_before": [r["load_average_before"] for r in rs], "config": rs[0]["config"],
                **({"cached_prompt_tokens": [r["cached_prompt_tokens"] for r in rs]} if name == "deepinfer" else {})}  # fmt: skip

    ours, theirs = summary("deepinfer"), summary(peer)
    return {
        "model": model,
        "workload": workload.describe(),
        "threads": threads,
        "git_commit": git_commit(),
        "deepinfer": ours,
        peer: theirs,
        "throughput_ratio": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
        "greedy_agreement": agreement(
            runs["deepinfer"][0]["output_token_ids"], runs[peer][0]["output_token_ids"]
        ),
        "deepinfer_mean_ttft_s": statistics.median(r["mean_ttft_s"] for r in runs["deepinfer"]),
    }
