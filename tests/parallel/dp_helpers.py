"""Shared pieces of the data-parallel tests: run prompts on one process and on N ranks, compare."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from deepinfer import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=96, max_model_len=512, enable_prefix_caching=True)


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of uneven lengths (3 .. 40 tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(3 + (i * 13) % 38)] for i in range(count)]


def params_for(count: int) -> list[SamplingParams]:
    """Greedy, uneven output lengths (so ranks finish at different steps), with decode and prompt
    logprobs to compare the logits."""
    return [
        SamplingParams(
            temperature=0, max_tokens=4 + (i * 7) % 17, ignore_eos=True, logprobs=3, prompt_logprobs=2
        )
        for i in range(count)
    ]


def compare(ref: list[Any], got: list[Any], tol: float = 1e-4) -> None:
    """Token-identical outputs; decode and prompt logprobs (log-softmax of the logits) within tol."""
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(ref, got):
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            for t in step_a:
                assert math.isclose(step_a[t].logprob, step_b[t].logprob, abs_tol=tol), (t, step_a, step_b)
        for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            if pa is None:
                assert pb is None
                continue
            for t in pa:
                assert math.isclose(pa[t].logprob, pb[t].logprob, abs_tol=tol)


def run_single(model: Path | str, prompts, params) -> list[Any]:
    llm = LLM(model=str(model), **ENGINE)
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def assert_all_blocks_free(llm: LLM) -> None:
    for load in llm.engine.loads:
        assert load.free_blocks == load.total_blocks, f"rank {load.rank} leaked KV blocks: {load}"
        assert load.num_running == load.num_waiting == 0
