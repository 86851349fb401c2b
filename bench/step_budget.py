"""Does the time-budget scheduler keep decode steps on target while a long prompt is prefilled?

    .venv/bin/python bench/step_budget.py [--model PATH] [--target-ms 60] [--prompt-len 8000]

16 requests decode; then one long prompt arrives. Every engine step is timed while that prompt is being
prefilled (until its first token). Reported: the steps' p50/p99 against the target with the time
budget (medians over reps, and the p99 of all reps' steps pooled, which decides the verdict), the same
run with fixed-size chunks (--fixed-chunk tokens) for contrast, and the long prompt's TTFT in both.
Configurations alternate over --reps runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.bench.offline import percentile
from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload
from deepinfer.malloc_tuning import reexec_with_malloc_tuning


def run(llm: LLM, decodes: list[list[int]], long_prompt: list[int]) -> dict:
    engine = llm.engine
    # Enough new tokens that every decode outlives the long prefill; the context length caps it.
    decode_params = SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True)
    for i, prompt in enumerate(decodes):
        engine.add_request(f"d{i}", None, prompt, decode_params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.add_request("long", None, long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    arrival = time.perf_counter()
    steps = []
    while "long" in engine.scheduler.requests:
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
        if any(f"d{i}" not in engine.scheduler.requests for i in range(len(decodes))):
            raise RuntimeError("a decode finished before the long prompt's prefill did; raise its max_tokens")
    ttft = time.perf_counter() - arrival
    engine.abort_request([f"d{i}" for i in range(len(decodes))])
    return {"steps": len(steps), "p50_step_s": percentile(steps, 50), "p99_step_s": percentile(steps, 99),
            "max_step_s": max(steps), "long_prompt_ttft_s": ttft, "step_s": steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--target-ms", type=float, default=60.0)
    parser.add_argument("--fixed-chunk", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/step_budget.json")
    args = parser.parse_args()
    reexec_with_malloc_tuning()

    budget = LLM(
        args.model,
        step_time_budget_ms=args.target_ms,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )
    fixed = LLM(args.model, long_prefill_token_threshold=args.fixed_chunk, max_num_batched_tokens=8192,
                enable_prefix_caching=False)  # fmt: skip
    tokenizer = budget.engine.tokenizer
    decodes = Workload(16, (64, 256), 1, seed=1).prompts(tokenizer)
    long_prompt = Workload(1, (args.prompt_len, args.prompt_len), 1, seed=2).prompts(tokenizer)[0]
    runs: dict[str, list[dict]] = {"time_budget": [], "fixed_chunk": []}
    for _ in range(args.reps):
        runs["time_budget"].append(run(budget, decodes, long_prompt))
        runs["fixed_chunk"].append(run(fixed, decodes, long_prompt))

    def summary(name: str) -> dict:
        pooled = [t for r in runs[name] for t in r["step_s"]]
        return {
            **{k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0] if k != "step_s"},
            "pooled_p99_step_s": percentile(pooled, 99),
        }

    target = args.target_ms / 1e3
    result = {
        "target_step_s": target,
        "prompt_len": args.prompt_len,
        "decodes": len(decodes),
        "time_budget": summary("time_budget"),
        "fixed_chunk": summary("fixed_chunk"),
        "fixed_chunk_tokens": args.fixed_chunk,
        "p99_within_25_percent_of_target": summary("time_budget")["pooled_p99_step_s"] <= 1.25 * target,
        "cost_model": asdict(budget.engine.cost_model),
        "reps": runs,
        "env": environment(budget.engine),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("target_step_s", "time_budget", "fixed_chunk", "p99_within_25_percent_of_target")
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
