"""CPU graphs on and off: decode step time per batch size, what a capture costs, and where a replayed
step's time goes.

    PYTHONPATH=. .venv/bin/python bench/cpu_graphs.py [--batches 1 8 64] [--steps 200] [--reps 3]

For each batch size, requests with 128-token prompts are prefilled, then ``--steps`` decode steps are
timed (the median step), with ``graph_capture`` off and on, each in a fresh process, alternating (A B A
B) for ``--reps`` rounds. With graphs on it also records what capturing the graph took (one eager
forward under the recorder plus building the native program) and, for the last round, each op's share
of one replay (``CpuGraph.replay_timed``, the minimum over 50 replays per op). Writes ``bench/results/cpu_graphs.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def child(batch: int, steps: int, graphs: bool, threads: int) -> dict:
    """One engine in this process: prefill ``batch`` requests, then time ``steps`` decode steps."""
    import torch

    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(graph_capture=graphs)
    engine = llm.engine
    captures: list[float] = []
    if graphs:
        decode_graphs = engine.runner.graphs
        capture = decode_graphs._capture

        def timed_capture(size: int) -> object:
            start = time.perf_counter()
            try:
                return capture(size)
            finally:
                captures.append(time.perf_counter() - start)

        decode_graphs._capture = timed_capture
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", None, [(7 * i + j) % 4000 + 5 for j in range(128)], params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step at this batch size: the capture, with graphs on
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    result = {"capture_s": sum(captures), "median_step_s": statistics.median(times)}
    graphs_held = engine.runner.graphs
    if graphs and graphs_held is not None and batch in graphs_held.graphs:
        graph = graphs_held.graphs[batch][0]
        best: dict[int, float] = {}
        names: list[str] = []
        with torch.inference_mode():
            for _ in range(50):
                timed = graph.replay_timed()
                names = [name for name, _ in timed]
                for i, (_, seconds) in enumerate(timed):
                    best[i] = min(best.get(i, seconds), seconds)
        by_op: dict[str, float] = defaultdict(float)
        for i, name in enumerate(names):
            by_op[name] += best[i]
        result["ops_per_replay"] = len(names)
        result["replay_op_seconds"] = dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
    return result


def run_child(batch: int, steps: int, graphs: bool, threads: int) -> dict:
    code = f"import json, bench.cpu_graphs as b; print(json.dumps(b.child({batch}, {steps}, {graphs}, {threads})))"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"batch {batch}, graphs {graphs} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from deepinfer.malloc_tuning import reexec_with_malloc_tuning

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_graphs.json"))
    args = parser.parse_args()
    reexec_with_malloc_tuning()
    results: dict[str, dict] = {}
    for batch in args.batches:
        runs: dict[str, list[dict]] = {"eager": [], "graphs": []}
        for rep in range(args.reps):
            order = [False, True] if rep % 2 == 0 else [True, False]
            for graphs in order:
                runs["graphs" if graphs else "eager"].append(
                    run_child(batch, args.steps, graphs, args.threads)
                )
        eager = statistics.median(r["median_step_s"] for r in runs["eager"])
        graphed = statistics.median(r["median_step_s"] for r in runs["graphs"])
        capture = statistics.median(r["capture_s"] for r in runs["graphs"])
        results[f"batch {batch}"] = {
            "eager_step_s": [r["median_step_s"] for r in runs["eager"]],
            "graph_step_s": [r["median_step_s"] for r in runs["graphs"]],
            "eager_over_graph": eager / graphed,
            "capture_cost_s": capture,
            "ops_per_replay": runs["graphs"][-1].get("ops_per_replay"),
            "replay_op_seconds": runs["graphs"][-1].get("replay_op_seconds"),
        }
        print(
            f"batch {batch}: eager {eager * 1e3:.2f} ms, graphs {graphed * 1e3:.2f} ms per decode step "
            f"({eager / graphed:.2f}x); a capture costs {capture * 1e3:.0f} ms once"
        )
    out = {"threads": args.threads, "steps": args.steps, "reps": args.reps, "load_average": os.getloadavg(),
           "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
