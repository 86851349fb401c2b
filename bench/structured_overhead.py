"""What structured outputs cost the rest of a batch.

    .venv/bin/python bench/structured_overhead.py [--model PATH] [--reps 3] [--out bench/results/structured_overhead.json]

Runs a batch of 32 unconstrained greedy requests (held-out stdlib prompts, 128 tokens each) alone and
with one JSON-schema-constrained request added, alternating A B A B, and reports the unconstrained
requests' throughput in both cases (median of reps), plus the mean time to fill one token mask (the
grammar backend's own time, measured on its helper thread, and in isolation).
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
from deepinfer.malloc_tuning import reexec_with_malloc_tuning

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "version": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    },
    "required": ["name", "version", "tags"],
    "additionalProperties": False,
}


def run(llm: LLM, prompts: list[list[int]], constrained: bool) -> float:
    """Output tokens/s of the unconstrained requests."""
    plain = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    batch, params = list(prompts), [plain] * len(prompts)
    if constrained:
        batch.append(prompts[0][:32])
        params.append(SamplingParams(temperature=1.0, seed=0, max_tokens=128, json_schema=SCHEMA))
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=batch, sampling_params=params)
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs[: len(prompts)]) / wall


def isolated_mask_time(llm: LLM, steps: int = 200) -> float:
    """Seconds per mask, filling masks for one matcher walking a JSON document, nothing else running."""
    structured = llm.engine.structured
    structured.add("probe", SamplingParams(json_schema=SCHEMA))
    matcher = structured.matchers["probe"]
    text = json.dumps({"name": "deepinfer", "version": 1, "tags": ["a", "b"]}, separators=(",", ":"))
    tokens = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    before_s, before_n = structured.mask_seconds, structured.mask_rows
    for i in range(steps):
        if i % len(tokens) == 0:
            matcher.reset()
        structured.start_masks([("probe", 0, [])], 1).result()
        structured.accept("probe", [tokens[i % len(tokens)]])
    structured.remove("probe")
    return (structured.mask_seconds - before_s) / (structured.mask_rows - before_n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/structured_overhead.json")
    args = parser.parse_args()
    reexec_with_malloc_tuning()
    llm = LLM(args.model)
    prompts = Workload(32, (64, 512), 128, seed=0).prompts(llm.engine.tokenizer)
    run(llm, prompts[:2], constrained=True)  # warm-up, grammar backend included
    alone, mixed = [], []
    structured = llm.engine.structured
    for _ in range(args.reps):
        alone.append(run(llm, prompts, constrained=False))
        before_s, before_n = structured.mask_seconds, structured.mask_rows
        mixed.append(run(llm, prompts, constrained=True))
        in_batch = (structured.mask_seconds - before_s) / (structured.mask_rows - before_n)
    result = {
        "unconstrained_tokens_per_s_alone": statistics.median(alone),
        "unconstrained_tokens_per_s_with_one_constrained": statistics.median(mixed),
        "throughput_ratio": statistics.median(mixed) / statistics.median(alone),
        "reps": {"alone": alone, "mixed": mixed},
        "mask_seconds_per_token_in_batch": in_batch,
        "mask_seconds_per_token_isolated": isolated_mask_time(llm),
        "env": environment(llm.engine),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("env", "reps")}, indent=2))


if __name__ == "__main__":
    main()
