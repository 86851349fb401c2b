"""Where the time of one decode step goes: host preparation, attention, MoE, dense layers, the LM head,
sampling, and what is left (Python and op-dispatch overhead between them).

    .venv/bin/python bench/decode_profile.py [--model PATH] [--batch 64] [--steps 30]

``--batch`` requests with prompts spread over --input-len-range are prefilled, then --steps pure decode
steps are timed with forward hooks on the model's modules (CPU: every op is synchronous, so a module's
wall time is its cost) and the runner's phases. Each part is reported as milliseconds per step and its
share of the step; the top aten ops of one profiled step are listed beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload
from deepinfer.malloc_tuning import reexec_with_malloc_tuning
from deepinfer.model.attention import MLAAttention
from deepinfer.model.moe import MoE


class PartTimer:
    """Accumulates the wall time of module forwards and wrapped callables, by part name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._start: dict[int, float] = {}

    def hook(self, module: nn.Module, part: str) -> None:
        def pre(mod: nn.Module, _args: object) -> None:
            self._start[id(mod)] = time.perf_counter()

        def post(mod: nn.Module, _args: object, _out: object) -> None:
            self.seconds[part] += time.perf_counter() - self._start.pop(id(mod))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def wrap(self, owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(64, 1024))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="bench/results/decode_profile.json")
    args = parser.parse_args()
    reexec_with_malloc_tuning()

    llm = LLM(args.model)
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    timer = PartTimer()
    for module in model.modules():
        if isinstance(module, MLAAttention):
            timer.hook(module, "attention (MLA: projections, rope, cache write, decode kernel)")
        elif isinstance(module, MoE):
            timer.hook(module, "MoE (routing, experts, shared expert)")
    for layer in model.layers:
        if not isinstance(layer.mlp, MoE):
            timer.hook(layer.mlp, "dense MLP")
    timer.wrap(model, "compute_logits", "LM head (logits of the sampled rows)")
    timer.wrap(runner, "prepare", "host: inputs and attention metadata")
    timer.wrap(runner, "_sample_and_verify", "sampling")  # includes compute_logits; separated below

    prompts = Workload(args.batch, tuple(args.input_len_range), 1, seed=3).prompts(engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, prompt, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm
        engine.step()

    timer.seconds.clear()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    timer.seconds["sampling"] -= timer.seconds["LM head (logits of the sampled rows)"]
    runner_s = sum(timer.seconds.values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    top_ops = [
        {"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    ]
    engine.abort_request([f"r{i}" for i in range(args.batch)])

    step_ms = statistics.fmean(walls) * 1e3
    parts = {name: s / args.steps * 1e3 for name, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1])}
    parts["rest: scheduler, output processing, Python and dispatch between the parts"] = (
        step_ms - runner_s / args.steps * 1e3
    )
    result = {
        "batch": args.batch,
        "mean_step_ms": step_ms,
        "p50_step_ms": statistics.median(walls) * 1e3,
        "parts_ms": parts,
        "parts_share": {k: v / step_ms for k, v in parts.items()},
        "top_ops_one_step": top_ops,
        "env": environment(engine),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"decode step at batch {args.batch}: {step_ms:.1f} ms")
    for name, ms in parts.items():
        print(f"  {ms:6.2f} ms  {ms / step_ms:5.1%}  {name}")


if __name__ == "__main__":
    main()
