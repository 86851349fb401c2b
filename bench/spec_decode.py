"""Speculative decoding on real prompts: speed-up at batch 1, acceptance per draft position, and
confidence gating at batch 32 — all with real acceptance accounting.

    .venv/bin/python bench/spec_decode.py [--model PATH] [--drafts 3] [--reps 3]

Batch 1: each held-out code prompt alone, greedy, 128 new tokens; decode tokens/s (after the first
token) without speculation and with MTP drafts (k = 1..--drafts), alternating, medians over reps; the
share of steps whose j-th draft was accepted, per position j; what a decode step costs (target forward,
drafting) and the speed-up those costs would allow if every draft were accepted. Batch 32: fixed-k MTP vs mtp-confidence
at the same k (the chain length the model's shipped head was trained on, 5 as in DSpark, unless
--gating-drafts; the head at its threshold, then a sweep of --thresholds): draft tokens verified per
step, mean accepted length (tokens emitted per request-step, bonus token included), throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.malloc_tuning import reexec_with_malloc_tuning

NEW_TOKENS = 128


def decode_speed(llm: LLM, prompts: list[list[int]]) -> float:
    """Median over prompts of (tokens after the first) / (time after the first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    speeds = []
    for prompt in prompts:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        m = out.metrics
        speeds.append((len(out.token_ids) - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(speeds)


def step_costs(llm: LLM, prompts: list[list[int]]) -> dict:
    """Each prompt alone, greedy, decode steps only (each prompt's prefill step is left out): mean
    milliseconds per engine step, of which the target forward and the MTP drafting, and tokens emitted
    per step. The forward and the drafter are wrapped with timers for the run."""
    engine, runner = llm.engine, llm.engine.runner
    spent = {"target_forward": 0.0, "drafting": 0.0}

    def timed(call, key: str):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    runner.model.forward = timed(runner.model.forward, "target_forward")
    if runner.proposer is not None:
        runner.proposer.propose = timed(runner.proposer.propose, "drafting")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    wall = forward = drafting = 0.0
    steps = tokens = 0
    try:
        for prompt in prompts:
            engine.add_request(engine.new_request_id(), None, prompt, params)
            emitted = len(engine.step()[0].token_ids)  # the prefill step
            while engine.has_unfinished_requests():
                spent.update(target_forward=0.0, drafting=0.0)
                start = time.perf_counter()
                (out,) = engine.step()
                wall += time.perf_counter() - start
                forward, drafting = forward + spent["target_forward"], drafting + spent["drafting"]
                steps, tokens, emitted = steps + 1, tokens + len(out.token_ids) - emitted, len(out.token_ids)
    finally:
        del runner.model.forward  # back to the class's method
        if runner.proposer is not None:
            del runner.proposer.propose
    return {"ms_per_step": 1e3 * wall / steps, "target_forward_ms": 1e3 * forward / steps,
            "drafting_ms": 1e3 * drafting / steps, "tokens_per_step": tokens / steps}  # fmt: skip


def acceptance_by_position(llm: LLM, prompts: list[list[int]], k: int) -> list[float]:
    """Share of verification steps in which draft j (1-based) was accepted."""
    proposer = llm.engine.runner.proposer
    proposer.trace = []
    llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    by_depth = [[] for _ in range(k)]
    for features, accepted in proposer.trace:
        by_depth[int(features[-1].item()) - 1].append(accepted)
    proposer.trace = None
    return [sum(d) / len(d) if d else 0.0 for d in by_depth]


def batch_run(llm: LLM, prompts: list[list[int]]) -> dict:
    llm.engine.spec_stats = SpecDecodeStats()
    start = time.perf_counter()
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    wall = time.perf_counter() - start
    s = llm.engine.spec_stats
    return {"output_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
            "verified_per_step": s.verified_tokens / s.request_steps, "mean_accepted_len": s.mean_accepted_len,
            **s.as_dict()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument(
        "--gating-drafts", type=int, default=None,
        help="k of the batch-32 gating comparison (default: the confidence head's trained chain length)",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--thresholds", type=float, nargs="*", default=[0.1, 0.3, 0.45],
        help="further gating thresholds to sweep at batch 32 (beside the head's shipped one)",
    )  # fmt: skip
    parser.add_argument("--out", default="bench/results/spec_decode.json")
    args = parser.parse_args()
    reexec_with_malloc_tuning()

    plain = LLM(args.model)
    spec = {k: LLM(args.model, speculative="mtp", num_draft_tokens=k) for k in range(1, args.drafts + 1)}
    prompts = Workload(args.prompts, (64, 512), NEW_TOKENS, seed=5).prompts(plain.engine.tokenizer)
    speeds: dict[str, list[float]] = {"off": [], **{f"mtp_k{k}": [] for k in spec}}
    for _ in range(args.reps):
        speeds["off"].append(decode_speed(plain, prompts))
        for k, llm in spec.items():
            speeds[f"mtp_k{k}"].append(decode_speed(llm, prompts))
    batch1 = {name: statistics.median(v) for name, v in speeds.items()}
    costs = {
        "off": step_costs(plain, prompts),
        **{f"mtp_k{k}": step_costs(llm, prompts) for k, llm in spec.items()},
    }
    plain_ms = costs["off"]["ms_per_step"]
    for k in spec:  # the speed-up if every draft were accepted, at the measured step costs
        costs[f"mtp_k{k}"]["speedup_at_full_acceptance"] = (
            (k + 1) * plain_ms / costs[f"mtp_k{k}"]["ms_per_step"]
        )
    result = {
        "batch1_decode_tokens_per_s": batch1,
        "batch1_speedup": {name: v / batch1["off"] for name, v in batch1.items()},
        "batch1_step_costs": costs,
        "acceptance_by_position": acceptance_by_position(spec[args.drafts], prompts, args.drafts),
    }

    batch_prompts = Workload(32, (64, 512), NEW_TOKENS, seed=6).prompts(plain.engine.tokenizer)
    gated = LLM(args.model, speculative="mtp-confidence", num_draft_tokens=args.gating_drafts)
    k = gated.engine.num_draft_tokens
    fixed_k = spec[k] if k in spec else LLM(args.model, speculative="mtp", num_draft_tokens=k)
    fixed_runs, gated_runs = [], []
    for _ in range(args.reps):
        fixed_runs.append(batch_run(fixed_k, batch_prompts))
        gated_runs.append(batch_run(gated, batch_prompts))

    def med(runs: list[dict]) -> dict:
        return {key: statistics.median(r[key] for r in runs) for key in runs[0]}

    fixed, gate = med(fixed_runs), med(gated_runs)
    result["batch32"] = {
        "drafts": k,
        "fixed_k": fixed,
        "confidence_gated": gate,
        "threshold": gated.engine.runner.proposer.threshold,
        "verified_per_step_reduction": 1 - gate["verified_per_step"] / fixed["verified_per_step"],
        "mean_accepted_len_drop": 1 - gate["mean_accepted_len"] / fixed["mean_accepted_len"],
        "throughput_change": gate["output_tokens_per_s"] / fixed["output_tokens_per_s"] - 1,
    }
    sweep = []
    for threshold in args.thresholds:
        llm = LLM(args.model, speculative="mtp-confidence", num_draft_tokens=k,
                  confidence_threshold=threshold)  # fmt: skip
        run = med([batch_run(llm, batch_prompts) for _ in range(args.reps)])
        sweep.append({
            "threshold": threshold,
            "verified_per_step_reduction": 1 - run["verified_per_step"] / fixed["verified_per_step"],
            "mean_accepted_len_drop": 1 - run["mean_accepted_len"] / fixed["mean_accepted_len"],
            "throughput_change": run["output_tokens_per_s"] / fixed["output_tokens_per_s"] - 1,
        })  # fmt: skip
    result["batch32"]["threshold_sweep"] = sweep
    result["env"] = environment(plain.engine)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=2))


if __name__ == "__main__":
    main()
