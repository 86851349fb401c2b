"""A request the KV cache can never hold is refused, never left waiting for blocks forever: a
``max_model_len`` beyond the cache is a startup error naming both numbers, the default context is
lowered to what the cache holds, and the scheduler refuses a request larger than its whole pool."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from tests.conftest import run_python

# Each case runs in a subprocess with a deadline: before the fix, generate() spun forever.
HANG_BOUND_S = 60
REPORTED = """
from deepinfer import LLM, SamplingParams
try:
    llm = LLM(num_kv_blocks=4, max_model_len=512, async_scheduling={async_})
except ValueError as exc:
    print("STARTUP", exc)
else:
    llm.generate(["def f(x):\\n    return 1\\n"], SamplingParams(max_tokens=100, ignore_eos=True))
    print("RETURNED")
"""
DEFAULT_CONTEXT = """
from deepinfer import LLM, SamplingParams
llm = LLM(num_kv_blocks=4, async_scheduling={async_})
print("CONTEXT", llm.engine.max_model_len)
try:
    llm.generate(["def f(x):\\n    return 1\\n"], SamplingParams(max_tokens=100, ignore_eos=True))
except ValueError as exc:
    print("REFUSED", exc)
out = llm.generate(["def f(x):\\n    return 1\\n"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
print("GENERATED", len(out.token_ids), llm.engine.kv_cache.num_free_blocks)
"""


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_max_model_len_beyond_the_cache_is_a_startup_error(async_: bool) -> None:
    done = run_python(REPORTED.format(async_=async_), timeout=HANG_BOUND_S)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("STARTUP"), line
    assert "max_model_len=512" in line and "64 tokens" in line and "4 KV blocks of 16" in line


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_default_context_fits_the_cache_and_oversized_requests_are_refused(async_: bool) -> None:
    done = run_python(DEFAULT_CONTEXT.format(async_=async_), timeout=HANG_BOUND_S)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert lines["CONTEXT"] == "64"
    assert "max_tokens=100" in lines["REFUSED"]
    assert lines["GENERATED"] == "20 4"  # a request that fits still runs, and frees its blocks


def test_speculative_draft_slots_count_against_the_cache() -> None:
    with pytest.raises(ValueError, match=r"max_model_len=64 .*\(1 per request kept for drafts\)"):
        LLM(num_kv_blocks=4, max_model_len=64, speculative="mtp")
    assert LLM(num_kv_blocks=4, speculative="mtp").engine.max_model_len == 63


def make(num_blocks: int, lookahead: int = 0) -> Scheduler:
    config = SchedulerConfig(8, 64, 1024, 64, num_lookahead_tokens=lookahead)
    return Scheduler(config, KVCacheManager(num_blocks, 4, True))


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(), 0, max_tokens, frozenset({0}), 0.0)


def test_scheduler_refuses_a_request_larger_than_its_pool() -> None:
    s = make(num_blocks=4)  # 16 tokens
    with pytest.raises(ValueError, match=r"10 tokens plus max_tokens=7 .* 4 blocks of 4 tokens"):
        s.add_request(req("big", 10, 7))
    assert not s.has_unfinished() and not s.requests
    s.add_request(req("fits", 10, 6))
    with pytest.raises(ValueError, match="kept for drafts"):
        make(num_blocks=4, lookahead=1).add_request(req("drafting", 10, 6))
