"""The engine survives what a server throws at it: an exception of any kind while a request is added
leaves nothing behind; an abort while an async step with prompt logprobs is in flight; and the prefix
cache counts each admission once, however long a request waits for room."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.structured.backend import GrammarError

PROMPT = "import os\n" * 20


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=64, max_num_batched_tokens=16)


def assert_clean(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.requests and not engine.outputs.states and not engine.outputs.parent_of
    assert not engine.structured.matchers and not engine._children
    assert engine.kv_cache.num_free_blocks == 64


@pytest.mark.parametrize("where", ["outputs", "scheduler", "grammar"])
def test_an_unexpected_exception_while_adding_leaves_nothing(llm: LLM, monkeypatch, where: str) -> None:
    engine = llm.engine
    boom = RuntimeError("injected failure")

    def fail(*args, **kwargs):
        raise boom

    target = {"outputs": engine.outputs, "scheduler": engine.scheduler, "grammar": engine.structured.backend}
    monkeypatch.setattr(
        target[where], {"outputs": "add", "scheduler": "add_request", "grammar": "matcher"}[where], fail
    )
    params = SamplingParams(n=3, max_tokens=4, regex="[a-z]{1,5}")
    expected = GrammarError if where == "grammar" else RuntimeError
    with pytest.raises(expected) as info:
        engine.add_request("r", PROMPT, None, params)
    assert info.value is boom or info.value.__cause__ is boom
    assert_clean(engine)
    monkeypatch.undo()
    # The same id is free again and the engine serves it.
    engine.add_request("r", PROMPT, None, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and all(c.text for c in outs[-1].outputs)
    assert_clean(engine)


def test_a_child_id_taken_by_another_request_is_refused(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("x#1", PROMPT, None, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", PROMPT, None, SamplingParams(n=2, max_tokens=2))
    assert list(engine.scheduler.requests) == ["x#1"]
    engine.abort_request("x#1")
    assert_clean(engine)


def test_abort_during_an_async_step_with_prompt_logprobs() -> None:
    llm = LLM(num_kv_blocks=64, async_scheduling=True, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("a", PROMPT, None, SamplingParams(max_tokens=4, prompt_logprobs=2))
    engine.add_request("b", "def f(x):", None, SamplingParams(max_tokens=4))
    engine.step()  # a's first prompt chunk is now in flight
    engine.abort_request("a")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b"]
    assert not engine.outputs.states and engine.kv_cache.num_free_blocks == 64


def test_prefix_cache_counts_each_admission_once() -> None:
    # 6 blocks of 4 tokens: while "a" runs, "b" waits for room and is tried at every step.
    s = Scheduler(SchedulerConfig(8, 64, 1024, 64), KVCacheManager(6, 4, True))
    a = Request("a", list(range(1, 21)), SamplingParams(), 0, 4, frozenset({0}), 0.0)
    b = Request("b", [*range(1, 9), *range(100, 108)], SamplingParams(), 0, 4, frozenset({0}), 0.0)
    s.add_request(a)
    s.add_request(b)
    waited = 0
    while b.num_cached_tokens < 0:
        out = s.schedule()
        s.update_from_output(out, {r.request_id: [7] for r in out.requests if r.samples})
        waited += 1
    assert waited > 3  # b really waited, tried at every step
    # One lookup per admission: a's 20 prompt tokens (no hits), b's 16 (its first 2 blocks, a's).
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (20 + 16, 8)
