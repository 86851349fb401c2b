"""The token-budget scheduler, without a model: chunking, mixing, budgets, preemption, stops."""

from __future__ import annotations

from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.sampling_params import SamplingParams


def make(num_blocks=64, budget=16, seqs=8, chunk=None, caching=True) -> Scheduler:
    config = SchedulerConfig(seqs, budget, 1024, chunk or budget)
    return Scheduler(config, KVCacheManager(num_blocks, 4, caching))


def req(rid: str, n: int, max_tokens: int = 4, **params) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(**params), 0, max_tokens, frozenset({0}), 0.0)


def step(s: Scheduler, token: int = 7) -> dict[str, int]:
    out = s.schedule()
    s.update_from_output(out, {r.request_id: [token] for r in out.requests if r.samples})
    return {r.request_id: r.num_new_tokens for r in out.requests}


def test_long_prompt_is_chunked_and_decodes_share_the_step() -> None:
    s = make(budget=16)
    s.add_request(req("short", 3))
    s.add_request(req("long", 40))
    assert step(s) == {"short": 3, "long": 13}
    assert step(s) == {"short": 1, "long": 15}  # decode + next chunk
    assert step(s) == {"short": 1, "long": 12}
    assert step(s) == {"short": 1, "long": 1}
    assert s.requests["long"].num_output_tokens == 2


def test_chunk_cap_and_sequence_limit() -> None:
    s = make(budget=64, seqs=2, chunk=8)
    for i in range(3):
        s.add_request(req(f"r{i}", 20))
    assert step(s) == {"r0": 8, "r1": 8}
    assert len(s.waiting) == 1


def test_preemption_frees_the_latest_request_and_recomputes_it_later() -> None:
    s = make(num_blocks=6, budget=64, caching=False)
    s.add_request(req("a", 10, max_tokens=8, ignore_eos=True))
    s.add_request(req("b", 10, max_tokens=8, ignore_eos=True))
    assert step(s) == {"a": 10, "b": 10}  # 3 + 3 blocks
    for _ in range(2):
        step(s)  # a and b grow to 12 tokens: still 3 blocks each
    scheduled = step(s)  # both need a 4th block: b is preempted
    assert scheduled == {"a": 1}
    assert s.requests["b"].status is RequestStatus.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    assert s.num_preemptions == 1
    while "a" in s.requests:
        step(s)
    scheduled = step(s)
    assert scheduled == {"b": 13}  # prompt + its 3 generated tokens, recomputed
    while s.has_unfinished():
        step(s)
    assert s.kv.num_free_blocks == 6


def test_stops_on_eos_stop_token_and_length() -> None:
    s = make()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("stoptok", 3, max_tokens=10, stop_token_ids=[9]))
    s.add_request(req("len", 3, max_tokens=2))
    out = s.schedule()
    s.update_from_output(out, {"eos": [0], "stoptok": [9], "len": [5]})
    out = s.schedule()
    s.update_from_output(out, {"len": [5]})
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_min_tokens_defers_eos() -> None:
    s = make()
    r = req("r", 3, max_tokens=10, min_tokens=2)
    s.add_request(r)
    s.update_from_output(s.schedule(), {"r": [0]})
    assert r.status is RequestStatus.RUNNING
    s.update_from_output(s.schedule(), {"r": [0]})
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_abort_anywhere_frees_blocks() -> None:
    s = make(budget=8)
    s.add_request(req("run", 6))
    s.add_request(req("wait", 30))
    step(s)
    s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64
