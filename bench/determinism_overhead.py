"""What deterministic (batch-invariant) mode costs: offline throughput with the mode on and off.

    .venv/bin/python bench/determinism_overhead.py [--model PATH] [--reps 3] [--threads N]
        [--out bench/results/determinism_overhead.json]

(about 2 minutes per rep on a 2-core machine, 1.9 measured under a load of 7-10; the load seen, from
``uptime``, is recorded before and after).

The bundled model by default, 64 requests (held-out stdlib prompts of 64-1024 tokens, 128 greedy output
tokens each, ``deepinfer bench offline``'s workload), run with ``deterministic=False`` and ``True``
alternately (A B A B ...; a fresh engine per run, since the mode is chosen when the engine activates
its backend), and the median output throughput of each side with their ratio. It also checks that the
greedy outputs of the two modes agree token for token (they may not be bit-identical in logits, but a
different token would point at a wrong formulation) and reports the share that does. Besides wall-clock
throughput it reports output tokens per CPU-second of this process (``time.process_time``), which other
jobs on a loaded host disturb far less than the wall clock; on a quiet host the two ratios agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from deepinfer import LLM
from deepinfer.bench.offline import run_offline
from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload
from deepinfer.cli import reexec_with_malloc_tuning
from deepinfer.model_zoo import default_model_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench/results/determinism_overhead.json")
    args = parser.parse_args()
    reexec_with_malloc_tuning()
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = Workload(num_requests=args.num_requests)
    uptime_before = _uptime()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    env = None
    for _ in range(args.reps):
        for deterministic in (False, True):
            llm = LLM(args.model, deterministic=deterministic)
            cpu_start = time.process_time()
            result = run_offline(llm, workload)
            result["output_tokens_per_cpu_s"] = result["output_tokens"] / (time.process_time() - cpu_start)
            env = env or environment(llm.engine)
            runs[deterministic].append(result)
            print(
                f"deterministic={deterministic}: {result['output_tokens_per_s']:.0f} output tok/s "
                f"({result['wall_s']:.1f} s), {result['output_tokens_per_cpu_s']:.0f} per CPU-second",
                flush=True,
            )
            del llm
    median = {d: statistics.median(r["output_tokens_per_s"] for r in rs) for d, rs in runs.items()}
    median_cpu = {d: statistics.median(r["output_tokens_per_cpu_s"] for r in rs) for d, rs in runs.items()}
    off_tokens, on_tokens = runs[False][0]["output_token_ids"], runs[True][0]["output_token_ids"]
    same = sum(a == b for a, b in zip(off_tokens, on_tokens)) / len(off_tokens)
    report = {
        "workload": workload.describe(),
        "reps": args.reps,
        "order": "A B A B (off, on), fresh engine per run",
        "output_tokens_per_s": {
            "off": [r["output_tokens_per_s"] for r in runs[False]],
            "on": [r["output_tokens_per_s"] for r in runs[True]],
        },
        "median_output_tokens_per_s": {"off": median[False], "on": median[True]},
        "on_over_off": median[True] / median[False],
        "slowdown_percent": 100.0 * (1.0 - median[True] / median[False]),
        "output_tokens_per_cpu_s": {
            "off": [r["output_tokens_per_cpu_s"] for r in runs[False]],
            "on": [r["output_tokens_per_cpu_s"] for r in runs[True]],
        },
        "median_output_tokens_per_cpu_s": {"off": median_cpu[False], "on": median_cpu[True]},
        "on_over_off_cpu": median_cpu[True] / median_cpu[False],
        "p50_step_ms": {
            "off": statistics.median(r["p50_step_s"] for r in runs[False]) * 1e3,
            "on": statistics.median(r["p50_step_s"] for r in runs[True]) * 1e3,
        },
        "greedy_outputs_identical_share": same,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "uptime_before": uptime_before,
        "uptime_after": _uptime(),
        "env": env,
    }
    print(
        f"median: off {median[False]:.0f} tok/s, on {median[True]:.0f} tok/s, on/off "
        f"{report['on_over_off']:.3f} ({report['slowdown_percent']:.1f}% slower); per CPU-second: on/off "
        f"{report['on_over_off_cpu']:.3f}; "
        f"greedy outputs identical for {same:.0%} of requests"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _uptime() -> str:
    """What ``uptime`` prints (the machine's load), or why it could not be read."""
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"uptime failed: {exc}"


if __name__ == "__main__":
    raise SystemExit(main())
