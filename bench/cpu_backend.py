"""The fast CPU op backend against the reference one, side by side in one run, on the bundled model.

    .venv/bin/python bench/cpu_backend.py [--reps 3] [--threads 1] [--out bench/results/cpu_backend.json]

Workloads (offline, greedy, ``ignore_eos``): 64 requests with prompts of 64-1024 tokens and 128 out,
and 1 request with a 128-token prompt and 128 out. Each repetition runs the reference backend and then
the fast one (A B A B ...), each in a fresh process (``DEEPINFER_CPU_BACKEND``) with the same thread
count and malloc settings; the report gives every rep, the medians, the ratio of medians, the load
average before each run, and whether the greedy tokens agree (fp32: must be identical). A bf16 run of
the 64-request workload per backend is compared with the fp32 reference's tokens. Finally
``bench/decode_profile.py`` splits one batch-64 decode step for each backend (alternating as well).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from deepinfer.bench.peer import agreement
from deepinfer.bench.report import git_commit
from deepinfer.bench.workload import Workload
from deepinfer.malloc_tuning import MALLOC_TUNABLES
from deepinfer.model_zoo import default_model_path
from deepinfer.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("reference", "fast")
WORKLOADS = {
    "64 requests, prompts 64-1024, 128 out": Workload(64, (64, 1024), 128, seed=0),
    "1 request, 128-token prompt, 128 out": Workload(1, (128, 128), 128, seed=0),
}


def _env(backend: str, threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "DEEPINFER_CPU_BACKEND": backend,
        "DEEPINFER_ACCELERATOR": "cpu",
        "GLIBC_TUNABLES": MALLOC_TUNABLES,
        "OMP_NUM_THREADS": str(threads),
        "DEEPINFER_NUM_THREADS": str(threads),
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def _offline(backend: str, job: dict, threads: int, tmp: Path) -> dict:
    job_path, result_path = tmp / "job.json", tmp / "result.json"
    job_path.write_text(json.dumps(job))
    load = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.bench.peers.deepinfer_driver", str(job_path), str(result_path)],
        env=_env(backend, threads),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(result_path.read_text())
    out["load_average_before"] = load
    return out


def _profile(backend: str, threads: int, tmp: Path, steps: int) -> dict:
    out = tmp / f"profile_{backend}.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "decode_profile.py"), "--steps", str(steps), "--out", str(out)],
        env=_env(backend, threads),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"decode profile ({backend}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return {
        k: result[k]
        for k in ("batch", "mean_step_ms", "p50_step_ms", "parts_ms", "parts_share", "top_ops_one_step")
    }


def _summary(runs: dict[str, list[dict]]) -> dict:
    tps = {b: [r["output_tokens_per_s"] for r in runs[b]] for b in BACKENDS}
    med = {b: statistics.median(v) for b, v in tps.items()}
    return {
        "output_tokens_per_s": tps,
        "median_output_tokens_per_s": med,
        "fast_over_reference": med["fast"] / med["reference"],
        "load_average_before": {b: [r["load_average_before"] for r in runs[b]] for b in BACKENDS},
        "greedy_agreement": agreement(
            runs["reference"][0]["output_token_ids"], runs["fast"][0]["output_token_ids"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_backend.json"))
    args = parser.parse_args()
    model = str(default_model_path())
    tokenizer = Tokenizer(model)
    report: dict = {"commit": git_commit(REPO), "threads": args.threads, "reps": args.reps, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for name, workload in WORKLOADS.items():
            job = {
                "model": model,
                "prompts": workload.prompts(tokenizer),
                "output_len": workload.output_len,
                "threads": args.threads,
                "engine_options": {"dtype": "float32"},
            }
            runs: dict[str, list[dict]] = {b: [] for b in BACKENDS}
            for rep in range(args.reps):
                for backend in BACKENDS:
                    runs[backend].append(_offline(backend, job, args.threads, tmp))
                    print(
                        f"{name} rep {rep} {backend}: {runs[backend][-1]['output_tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
            report["workloads"][name] = {"workload": workload.describe(), **_summary(runs)}
            if workload.num_requests == 64:
                fp32_reference = runs["reference"][0]["output_token_ids"]
                bf16 = {}
                for backend in BACKENDS:
                    run = _offline(
                        backend, {**job, "engine_options": {"dtype": "bfloat16"}}, args.threads, tmp
                    )
                    bf16[backend] = {
                        "output_tokens_per_s": run["output_tokens_per_s"],
                        "agreement_with_fp32_reference": agreement(fp32_reference, run["output_token_ids"]),
                    }
                    print(f"{name} bf16 {backend}: {run['output_tokens_per_s']:.1f} tok/s", flush=True)
                report["workloads"][name]["bfloat16"] = bf16
        report["decode_profile"] = {b: _profile(b, args.threads, tmp, args.profile_steps) for b in BACKENDS}
    report["decode_profile"]["fast_over_reference_step"] = (
        report["decode_profile"]["reference"]["mean_step_ms"]
        / report["decode_profile"]["fast"]["mean_step_ms"]
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for name, w in report["workloads"].items():
        med = w["median_output_tokens_per_s"]
        print(
            f"{name}: reference {med['reference']:.1f} tok/s, fast {med['fast']:.1f} tok/s, "
            f"{w['fast_over_reference']:.2f}x; greedy identical share {w['greedy_agreement']['identical_share']:.2f}"
        )
    p = report["decode_profile"]
    print(
        f"decode step at batch 64: reference {p['reference']['mean_step_ms']:.1f} ms, "
        f"fast {p['fast']['mean_step_ms']:.1f} ms ({p['fast_over_reference_step']:.2f}x)"
    )


if __name__ == "__main__":
    main()
