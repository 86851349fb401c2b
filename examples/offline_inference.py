"""Offline batch inference with the Python API.

    .venv/bin/python examples/offline_inference.py [--model PATH]

Completes a batch of prompts in one call (they are scheduled together: continuous batching with
chunked prefill), with per-prompt sampling parameters, and prints each completion with its timings.
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import json\n\n\ndef read_config(path):",
    "class Stack:\n    def __init__(self):",
    "# Return the n-th prime number\ndef nth_prime(n):",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: the bundled deepinfer-tiny-coder)")
    args = parser.parse_args()

    llm = LLM(args.model)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=64, n=2)
    outputs = llm.generate(PROMPTS, [greedy, greedy, sampled, greedy])
    for out in outputs:
        print("=" * 80)
        print(out.prompt)
        for completion in out.outputs:
            print(
                f"--- completion {completion.index} ({completion.finish_reason}, {len(completion.token_ids)} tokens)"
            )
            print(completion.text)
        print(
            f"[TTFT {out.metrics.ttft * 1000:.1f} ms, {out.num_cached_tokens} prompt tokens from the prefix cache]"
        )


if __name__ == "__main__":
    main()
