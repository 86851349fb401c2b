"""Offline decode speed on an idle host and beside two busy processes (issue 34, defect 19).

    .venv/bin/python bench/busy_host.py [--reps 3] [--max-tokens 256] [--busy 2]
        [--out bench/results/busy_host.json]

Each rep runs ``python -m deepinfer.run`` (the bundled model, a fixed prompt, greedy, ``--max-tokens``
tokens past any EOS, ``--json``, whose ``decode_tokens_per_s`` is the figure) twice, alternating: on
the host as it is ("idle"), then with ``--busy`` CPU-bound children (``python -c 'while True:
pass'``) started before it and stopped by PID after it ("busy"). The children of ``deepinfer.run`` get
this process's environment without ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``, so the entry point's own thread policy
(``deepinfer.threads``) is what is measured. Records the commit, ``lscpu``'s model name, the load
average around every run, each run's figures, the medians and ``busy / idle``; the acceptance is
busy >= 0.5x idle. About 15 s a rep on a quiet 2-core host (the busy runs take longest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deepinfer.bench.report import git_commit
from deepinfer.threads import USER_CHOICES

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):\n    "
ACCEPTANCE = 0.5  # busy / idle decode speed at least this
RUN_TIMEOUT_S = 600
BUSY_SETTLE_S = 1.0  # the busy children run this long before the measured run starts


def cpu_model() -> str:
    """``lscpu``'s "Model name" (the host's CPU, which moves every ratio: FACTS.md)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, check=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    raise RuntimeError("lscpu printed no 'Model name:' line")


def start_busy(count: int) -> list[subprocess.Popen]:
    """``count`` CPU-bound Python children (stop them with :func:`stop`)."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]


def stop(children: list[subprocess.Popen]) -> None:
    """Stop each child by its PID: SIGTERM, then SIGKILL after 5 s; reap it."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=5)


def decode_once(max_tokens: int) -> dict:
    """One ``python -m deepinfer.run --json`` run: its JSON row plus the wall time."""
    env = {k: v for k, v in os.environ.items() if k not in USER_CHOICES}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.run", "--max-tokens", str(max_tokens), "--ignore-eos", "--json", PROMPT],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"deepinfer.run exited {proc.returncode}: {proc.stderr[-2000:]}")
    row = json.loads(proc.stdout.splitlines()[-1])
    return {
        "decode_tokens_per_s": row["decode_tokens_per_s"],
        "ttft_s": row["ttft_s"],
        "generated_tokens": row["generated_tokens"],
        "wall_s": time.monotonic() - start,
    }


def measure(side: str, rep: int, busy: int, max_tokens: int) -> dict:
    children = start_busy(busy) if side == "busy" else []
    try:
        if children:
            time.sleep(BUSY_SETTLE_S)
        load_before = os.getloadavg()
        result = decode_once(max_tokens)
        if any(c.poll() is not None for c in children):
            raise RuntimeError("a busy child exited during the run")
    finally:
        stop(children)
    record = {"rep": rep, "side": side, **result, "load_average_before": load_before,
              "load_average_after": os.getloadavg()}  # fmt: skip
    print(json.dumps(record), flush=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound children beside the busy runs")
    parser.add_argument("--out", default=str(REPO / "bench/results/busy_host.json"))
    args = parser.parse_args()
    if args.reps < 1 or args.max_tokens < 2 or args.busy < 1:
        parser.error("--reps and --busy must be >= 1 and --max-tokens >= 2")
    runs = [
        measure(side, rep, args.busy, args.max_tokens)
        for rep in range(args.reps)
        for side in ("idle", "busy")
    ]
    medians = {
        side: statistics.median(r["decode_tokens_per_s"] for r in runs if r["side"] == side)
        for side in ("idle", "busy")
    }
    ratio = medians["busy"] / medians["idle"]
    result = {
        "benchmark": "busy_host",
        "git_commit": git_commit(REPO),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "command": f"python -m deepinfer.run --max-tokens {args.max_tokens} --ignore-eos --json {PROMPT!r}",
        "omp_wait_policy_of_this_process": os.environ.get("OMP_WAIT_POLICY"),
        "busy_processes": args.busy,
        "reps": args.reps,
        "runs": runs,
        "median_decode_tokens_per_s": medians,
        "busy_over_idle": ratio,
        "acceptance": {"busy_over_idle_at_least": ACCEPTANCE, "met": ratio >= ACCEPTANCE},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"idle {medians['idle']:.0f} tok/s, busy {medians['busy']:.0f} tok/s: busy/idle {ratio:.2f} "
          f"(acceptance >= {ACCEPTANCE}: {'met' if ratio >= ACCEPTANCE else 'NOT met'}); wrote {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
