"""Offline throughput: every request of a workload submitted at once, run to completion.

Reports output tokens/s, mean TTFT, per-step time percentiles (every engine step is timed), and the
speculative-decoding counters when the engine has them.
"""

from __future__ import annotations

import statistics
import time

from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def run_offline(llm: LLM, workload: Workload, prompts: list[list[int]] | None = None) -> dict:
    """Run the workload once (after a short warm-up) and return the measurements."""
    engine = llm.engine
    prompts = prompts if prompts is not None else workload.prompts(engine.tokenizer)
    # Warm-up on 8-token heads of two prompts, as every peer driver does: shorter than a KV block, so the
    # prefix cache holds nothing of the measured prompts afterwards.
    warmup = [p[:8] for p in prompts[:2]]
    llm.generate(prompt_token_ids=warmup, sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    engine.spec_stats = SpecDecodeStats()
    ids = [engine.new_request_id() for _ in prompts]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, None, prompt, params)
    steps: list[float] = []
    finished = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t0)
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
    wall = time.perf_counter() - start
    outs = [finished[rid] for rid in ids]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    input_tokens = sum(len(p) for p in prompts)
    result = {
        "requests": len(outs),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (input_tokens + output_tokens) / wall,
        "mean_ttft_s": statistics.fmean(o.metrics.ttft for o in outs),
        "steps": len(steps),
        "p50_step_s": percentile(steps, 50),
        "p99_step_s": percentile(steps, 99),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),  # prefix-cache hits
        "preemptions": engine.scheduler.num_preemptions,
        "speculative": engine.config.speculative,
        "num_draft_tokens": engine.num_draft_tokens,
        **engine.spec_stats.as_dict(),
        "workload": workload.describe(),
        "env": environment(engine),
        "output_token_ids": [o.outputs[0].token_ids for o in outs],
    }
    return result
