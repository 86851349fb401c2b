"""The engine end to end on a tiny random model: prefix caching, preemption, aborts, stop rules,
sampling parameters, log-probabilities and the streaming interface."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def count_computed_tokens(llm: LLM) -> list[int]:
    """Wrap the model runner so every step's scheduled token count is recorded."""
    counts: list[int] = []
    execute = llm.engine.runner.execute

    def counting(scheduled):
        counts.append(scheduled.num_tokens)
        return execute(scheduled)

    llm.engine.runner.execute = counting
    return counts


def test_prefix_cache_skips_a_shared_three_block_prefix(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    block = llm.engine.cache_spec.block_size
    shared = [(7 * i + 3) % 300 + 2 for i in range(3 * block)]
    first, second = [*shared, 11, 12, 13], [*shared, 21, 22, 23, 24, 25]
    counts = count_computed_tokens(llm)
    out1 = llm.generate(prompt_token_ids=[first], sampling_params=GREEDY)[0]
    computed_first = sum(counts)
    out2 = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 3 * block
    # prompt tail (5 tokens) + 11 decode steps: the 48 shared tokens were not recomputed
    assert sum(counts) - computed_first == 5 + GREEDY.max_tokens - 1

    uncached = LLM(str(tiny_model), num_kv_blocks=64, enable_prefix_caching=False)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    for params in (GREEDY, sampled):
        with_cache = llm.generate(prompt_token_ids=[first, second], sampling_params=params)
        without = uncached.generate(prompt_token_ids=[first, second], sampling_params=params)
        assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]


def test_running_out_of_blocks_preempts_and_still_finishes_correctly(tiny_model: Path) -> None:
    prompts = [[(i * 13 + j) % 300 + 2 for j in range(20 + 7 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = LLM(str(tiny_model), num_kv_blocks=128).generate(prompt_token_ids=prompts, sampling_params=params)
    tight_llm = LLM(str(tiny_model), num_kv_blocks=12, enable_prefix_caching=False)
    tight = tight_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight_llm.engine.kv_cache.num_free_blocks == 12


def test_a_thousand_random_aborts_return_every_block(tiny_model: Path) -> None:
    engine = LLM(str(tiny_model), num_kv_blocks=96, max_num_batched_tokens=64).engine
    rng = random.Random(0)
    live: list[str] = []
    aborted = added = 0
    while aborted < 1000:
        while len(live) < 24:
            rid = f"r{added}"
            added += 1
            prompt = [rng.randrange(2, 300) for _ in range(rng.randrange(1, 60))]
            engine.add_request(
                rid, None, prompt, SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 40))
            )
            live.append(rid)
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
        for rid in rng.sample(live, k=min(len(live), rng.randrange(0, 8))):
            engine.abort_request(rid)
            live.remove(rid)
            aborted += 1
    engine.abort_request(live)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == 96
    assert not engine.outputs.states and not engine._children


def test_stop_strings_tokens_and_lengths(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    base = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[
        0
    ]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    text = base.text
    assert len(text) > 4
    stop = text[2:4]
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        ["def add(a, b):"],
        SamplingParams(temperature=0.0, max_tokens=24, stop=stop, include_stop_str_in_output=True),
    )[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    token = base.token_ids[5]
    by_id = llm.generate(
        ["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[token])
    )[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(token) + 1]
    assert by_id.outputs[0].stop_reason == token


def test_eos_ends_a_request_unless_ignored(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=1)
    eos = llm.engine.eos_token_ids
    outs = llm.generate(prompt_token_ids=[[2, 3, 4]] * 1, sampling_params=[params])
    for out in outs:
        assert out.finish_reason == "length" or out.token_ids[-1] in eos
        assert not any(t in eos for t in out.token_ids[:-1])


def test_seeds_make_sampling_reproducible_and_batch_invariant(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    prompt = [[5, 6, 7, 8, 9]]
    p = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=prompt, sampling_params=p)[0].token_ids
    others = [[i + 2, i + 3] for i in range(5)]
    crowd = llm.generate(
        prompt_token_ids=others + prompt,
        sampling_params=[SamplingParams(temperature=0.9, max_tokens=9)] * 5 + [p],
    )[-1].token_ids
    assert alone == crowd
    other_seed = llm.generate(prompt_token_ids=prompt, sampling_params=p.model_copy(update={"seed": 99}))[0]
    assert other_seed.token_ids != alone


def test_n_completions_differ_and_share_the_prompt(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    out = llm.generate(
        ["for i in range"], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_logprobs_and_prompt_logprobs(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=params)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3 and max(lp.logprob for lp in entry.values()) == entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    for token, entry in zip([6, 7, 8], out.prompt_logprobs[1:]):
        assert token in entry and entry[token].logprob <= 0


def test_prompt_logprobs_are_complete_after_a_prefix_cache_hit(tiny_model: Path) -> None:
    """A request asking for prompt log-probabilities is not served from the prefix cache (the cached
    positions' logits are never computed): every position is scored, the same as the first time."""
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    prompt = list(range(5, 5 + 3 * 16 + 5))  # three full blocks and a partial one
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=scored)[0].prompt_logprobs
    llm.generate(prompt_token_ids=[prompt], sampling_params=plain)  # the prefix is cached now
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=scored)[0].prompt_logprobs
    assert first[0] is None and again[0] is None and len(again) == len(prompt)
    assert all(entry is not None for entry in again[1:])
    for token, a, b in zip(prompt[1:], first[1:], again[1:]):
        assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)


def test_streaming_interface_deltas_add_up(tiny_model: Path) -> None:
    engine = LLM(str(tiny_model), num_kv_blocks=64).engine
    engine.add_request("s", "print(", None, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert out.finished and len(out.outputs[0].token_ids) == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt_token_ids=[[]]), "prompt is empty"),
        (dict(prompt_token_ids=[[5, 100000]]), "outside the vocabulary"),
        (dict(prompt_token_ids=[[5] * 600]), "context length is 512"),
    ],
)
def test_bad_prompts_are_rejected_clearly(tiny_model: Path, kwargs, message: str) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        llm.generate(**kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_beyond_context_names_the_limit(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=64)
    with pytest.raises(ValueError, match="at most 502 new tokens fit"):
        llm.generate(prompt_token_ids=[[5] * 10], sampling_params=SamplingParams(max_tokens=600))


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("logprobs", 99), ("stop", [""])]
)
def test_invalid_sampling_params_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
