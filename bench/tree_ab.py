"""Two source trees side by side on ``deepinfer bench offline``: A B A B, a fresh process per run.

For comparing a change against the tree it started from on a noisy host: each rep runs both trees back
to back, in alternating order, on the same workload, and the ratio is taken per rep and as the ratio
of medians. Every rep's figures are kept.

    PYTHONPATH=. .venv/bin/python bench/tree_ab.py --old /work/main --new . --reps 3
    # ~4 min on a quiet 2-core host (1-request and 64-request workloads, 3 reps each)

Writes ``bench/results/tree_ab.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKLOADS = {
    "1 request, 128-token prompt, 128 out": [
        "--num-requests", "1", "--input-len-range", "128", "128", "--output-len", "128",
    ],
    "64 requests, default workload": [],
}  # fmt: skip


def run_offline(tree: Path, args: list[str], threads: int) -> dict:
    """One ``deepinfer bench offline --json`` run of ``tree``'s code in a fresh process."""
    command = [sys.executable, "-m", "deepinfer.cli", "bench", "offline", *args]
    command += ["--threads", str(threads), "--json"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} in {tree} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    return {k: result[k] for k in ("output_tokens_per_s", "p50_step_s", "p99_step_s", "mean_ttft_s", "steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the baseline source tree")
    parser.add_argument("--new", type=Path, required=True, help="the changed source tree")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workload", choices=list(WORKLOADS), action="append", help="default: all")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tree_ab.json"))
    args = parser.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    report: dict = {"trees": {k: str(v) for k, v in trees.items()}, "threads": args.threads, "workloads": {}}
    for name in args.workload or list(WORKLOADS):
        reps = []
        for rep in range(args.reps):
            order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
            runs = {side: run_offline(trees[side], WORKLOADS[name], args.threads) for side in order}
            runs["ratio"] = runs["new"]["output_tokens_per_s"] / runs["old"]["output_tokens_per_s"]
            reps.append(runs)
            print(
                f"{name} rep {rep}: old {runs['old']['output_tokens_per_s']:.1f} tok/s, "
                f"new {runs['new']['output_tokens_per_s']:.1f} tok/s, new/old {runs['ratio']:.2f}",
                flush=True,
            )
        medians = {
            side: statistics.median(r[side]["output_tokens_per_s"] for r in reps) for side in ("old", "new")
        }
        report["workloads"][name] = {
            "reps": reps,
            "median_tok_s": medians,
            "ratio_of_medians": medians["new"] / medians["old"],
        }
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    report["load_average_after"] = load
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v["ratio_of_medians"] for k, v in report["workloads"].items()}))


if __name__ == "__main__":
    main()
