"""Multi-iteration decode steps (``max_decode_steps``): when the scheduler runs them, that they reserve
and roll back KV slots exactly, and that a request's output is the one single steps give, whatever it
samples with."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def make(max_steps: int = 8, num_blocks: int = 64, lookahead: int = 0) -> Scheduler:
    config = SchedulerConfig(8, 64, 1024, 64, num_lookahead_tokens=lookahead, max_decode_steps=max_steps)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, True))


def req(rid: str, n: int = 6, max_tokens: int = 20, **params) -> Request:
    """A request of ``n`` prompt tokens, distinct per id (no prefix-cache sharing between them)."""
    first = 100 * (ord(rid[0]) - ord("a") + 1)
    prompt = list(range(first, first + n))
    return Request(rid, prompt, SamplingParams(**params), 0, max_tokens, frozenset({0}), 0.0)


def prefill(s: Scheduler) -> None:
    """Schedule and apply the prompts' step; then a decode iteration is known to take 0.5 ms."""
    out = s.schedule()
    s.update_from_output(out, {r.request_id: [7] for r in out.requests if r.samples})
    s.decode_iteration = (0.0005, len(s.running))


def test_iterations_follow_the_window_the_batch_and_max_tokens() -> None:
    s = make()
    s.add_request(req("a", max_tokens=20))
    out = s.schedule()
    assert out.decode_steps == 1  # a prompt in the step
    s.update_from_output(out, {"a": [7]})
    assert s.schedule().decode_steps == 1  # no decode iteration timed yet
    s = make()
    s.add_request(req("a", max_tokens=20))
    prefill(s)
    assert s.schedule().decode_steps == 8  # 4 ms window / 0.5 ms, capped at max_decode_steps
    s2 = make()
    s2.add_request(req("a", max_tokens=20))
    prefill(s2)
    s2.decode_iteration = (0.002, 1)
    assert s2.schedule().decode_steps == 2  # 4 ms / 2 ms
    s3 = make()
    s3.add_request(req("a", max_tokens=3))
    prefill(s3)
    assert s3.schedule().decode_steps == 2  # the request may emit only 2 more tokens
    s4 = make()
    for rid in "abcd":
        s4.add_request(req(rid))
    prefill(s4)
    s4.decode_iteration = (0.0005, 1)  # measured at one request: scaled to four, 2 ms
    assert s4.schedule().decode_steps == 2


@pytest.mark.parametrize(
    "case",
    ["waiting", "constrained", "speculative", "off"],
)
def test_single_iteration_where_the_host_is_needed_between_tokens(case: str) -> None:
    s = make(max_steps=1 if case == "off" else 8, lookahead=2 if case == "speculative" else 0)
    s.add_request(req("a", regex="[a-z]+") if case == "constrained" else req("a"))
    prefill(s)
    if case == "waiting":  # a new arrival is admitted next step, not after a run of iterations
        s.add_request(req("b"))
    out = s.schedule()
    assert out.decode_steps == 1
    if case == "waiting":
        assert [r.request_id for r in out.requests] == ["a", "b"]


def test_slots_are_reserved_then_rolled_back_to_what_was_emitted() -> None:
    s = make()
    r = req("a", n=6, max_tokens=30, ignore_eos=True)
    s.add_request(r)
    prefill(s)  # 7 tokens, 6 computed
    out = s.schedule()
    k = out.decode_steps
    assert k == 8
    # slots for positions 6 .. 6 + k - 1 are held: ceil((6 + 8) / 4) blocks
    assert len(s.kv.block_ids("a")) == -(-(6 + k) // BLOCK)
    s.update_from_output(out, {"a": list(range(10, 10 + k))})
    assert r.num_tokens == 7 + k and r.num_computed_tokens == r.num_tokens - 1
    # a stop inside the run: the tokens after it are dropped, the request ends and frees its blocks
    r2 = req("b", n=6, max_tokens=30, stop_token_ids=[99])
    s.add_request(r2)
    prefill(s)
    out = s.schedule()
    s.update_from_output(out, {"b": [5, 99, 6, 6, 6, 6, 6, 6][: out.decode_steps]})
    assert r2.status is RequestStatus.FINISHED_STOPPED and r2.output_token_ids == [7, 5, 99]
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_no_room_for_the_iterations_ahead_falls_back_to_one_without_preempting() -> None:
    # 7 blocks of 4; after their prompts (6 tokens each) three requests hold 2 blocks each. Five more
    # iterations need a third block each: the first request gets the last free one, the second finds
    # none, and the step runs one iteration for all instead of preempting anyone.
    s = make(num_blocks=7)
    requests = [req(rid, n=6, max_tokens=6, ignore_eos=True) for rid in "abc"]
    for r in requests:
        s.add_request(r)
    prefill(s)
    out = s.schedule()
    assert out.decode_steps == 1 and s.num_preemptions == 0 and len(out.requests) == 3
    s.update_from_output(out, {r.request_id: [8] for r in out.requests})
    while s.has_unfinished():
        out = s.schedule()
        s.update_from_output(out, {r.request_id: [9] * out.decode_steps for r in out.requests})
    assert all(r.num_output_tokens == 6 for r in requests) and s.kv.num_free_blocks == 7


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=5, max_tokens=29, ignore_eos=True),
    "penalties+logprobs+min_tokens": SamplingParams(
        temperature=0.7,
        seed=3,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        logprobs=3,
        max_tokens=23,
        min_tokens=5,
    ),
    "stop tokens": SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[290, 22, 75]),
    "stop string": SamplingParams(temperature=0.0, max_tokens=40, stop=["(", "x"]),
}


def run(model: Path, steps: int) -> tuple[dict, Counter]:
    llm = LLM(str(model), max_decode_steps=steps, num_kv_blocks=256)
    engine = llm.engine
    seen: Counter = Counter()
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        seen[out.decode_steps] += 1
        return out

    engine.scheduler.schedule = counting
    prompts = [[(7 * j + i) % 4000 + 5 for j in range(20 + 13 * i)] for i in range(3)]
    results = {}
    for name, params in CASES.items():
        for batch in (prompts[:1], prompts):
            outs = llm.generate(prompt_token_ids=batch, sampling_params=params)
            results[name, len(batch)] = [
                (
                    o.outputs[0].token_ids,
                    o.outputs[0].text,
                    o.outputs[0].finish_reason,
                    [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []],
                )
                for o in outs
            ]
    pool = engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked, whatever stopped where
    return results, seen


def test_outputs_equal_single_steps(tiny_model: Path) -> None:
    single, single_steps = run(tiny_model, 1)
    multi, multi_steps = run(tiny_model, 8)
    assert set(single_steps) == {1}
    assert max(multi_steps) > 1  # the runs did use several iterations per step
    for key in single:
        assert multi[key] == single[key], key
