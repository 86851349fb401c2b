"""Asynchronous scheduling (step N+1 planned while step N computes) gives the synchronous outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(3, 90))] for _ in range(10)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.5),
    ],
    ids=["greedy", "seeded", "penalties"],
)
@pytest.mark.parametrize("blocks", [400, 14], ids=["roomy", "preempting"])
def test_async_equals_sync(tiny_model: Path, params: SamplingParams, blocks: int) -> None:
    options = dict(num_kv_blocks=blocks, max_num_batched_tokens=64, enable_prefix_caching=False)
    sync = LLM(str(tiny_model), **options).generate(prompt_token_ids=workload(), sampling_params=params)
    async_llm = LLM(str(tiny_model), async_scheduling=True, **options)
    out = async_llm.generate(prompt_token_ids=workload(), sampling_params=params)
    assert [o.token_ids for o in out] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in out] == [o.finish_reason for o in sync]
    assert async_llm.engine.kv_cache.num_free_blocks == blocks


def test_stop_strings_and_aborts_with_a_step_in_flight(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=200, async_scheduling=True)
    base = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[
        0
    ]
    stop = base.text[3:5]
    stopped = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == base.text[: base.text.index(stop)]

    engine = llm.engine
    for i in range(6):
        engine.add_request(f"a{i}", None, [5 + i] * 30, SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None
    engine.abort_request([f"a{i}" for i in range(0, 6, 2)])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._inflight is None
    assert engine.kv_cache.num_free_blocks == 200
