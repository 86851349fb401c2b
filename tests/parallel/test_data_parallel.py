"""Data parallelism + expert parallelism over spawned gloo ranks on loopback: outputs equal one process.

Every test here starts real rank processes (spawn, torch.distributed gloo); the front stops them by PID
when the test ends, and each test checks none is left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model_zoo import default_model_path
from deepinfer.parallel.placement import expert_weight_bytes
from tests.model.hf_models import make_hf_checkpoint
from tests.parallel.dp_helpers import (
    ENGINE,
    assert_all_blocks_free,
    compare,
    params_for,
    prompts_for,
    run_single,
)


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_NUM_THREADS", "1")  # the ranks share this machine's cores


def start(model: Path | str, world: int, **options) -> LLM:
    return LLM(model=str(model), data_parallel_size=world, enable_expert_parallel=True, **ENGINE, **options)


def stop(llm: LLM) -> None:
    procs = llm.engine.procs
    llm.close()
    assert all(not p.is_alive() for p in procs), "a rank process outlived close()"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_two_ranks_match_one_process_on_bundled_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bundled model, 2 ranks, experts sharded: greedy tokens identical and logprobs within fp32
    tolerance on an uneven batch whose requests finish at different steps; then one request alone (the
    other rank idles through zero-token forwards); every KV block free on every rank at the end; each
    rank holds half the experts; the collective-sequence check (debug mode) finds every step in order."""
    monkeypatch.setenv("DEEPINFER_DP_CHECK_COLLECTIVES", "1")
    model = default_model_path()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts, params = prompts_for(vocab, 5), params_for(5)
    ref = run_single(model, prompts, params)
    alone_ref = run_single(model, prompts[:1], params[4:5])
    llm = start(model, 2)
    try:
        compare(ref, llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert_all_blocks_free(llm)
        compare(alone_ref, llm.generate(prompt_token_ids=prompts[:1], sampling_params=params[4:5]))
        assert_all_blocks_free(llm)
        stats = llm.engine.collect_stats()
        # balanced: 3 + 2 (fewest active requests first), then the lone one to rank 0 (a tie: lowest rank)
        assert [s.requests_added for s in stats] == [4, 2]
        assert stats[1].idle_steps >= params[4].max_tokens  # rank 1 idled while rank 0 ran alone...
        assert min(stats[1].received[-params[4].max_tokens :]) > 0  # ...still computing its experts
        full = expert_weight_bytes(LLM(model=str(model), **ENGINE).engine.model)
        assert all(load.expert_weight_bytes * 2 == full for load in llm.engine.loads)
    finally:
        stop(llm)


@pytest.mark.slow
@pytest.mark.parametrize(("experts", "redundant"), [(8, 0), (16, 2)])
def test_two_ranks_match_one_process_on_random_v3(tmp_path: Path, experts: int, redundant: int) -> None:
    """Random DeepSeek-V3 configs (8 and 16 routed experts; the 16-expert one with 2 redundant slots, so
    tokens are spread over replicas) give the same tokens and logprobs on 2 ranks as on one process."""
    make_hf_checkpoint(tmp_path, seed=experts, n_routed_experts=experts)
    prompts, params = prompts_for(256, 7, seed=experts), params_for(7)
    ref = run_single(tmp_path, prompts, params)
    llm = start(tmp_path, 2, num_redundant_experts=redundant)
    try:
        compare(ref, llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert_all_blocks_free(llm)
    finally:
        stop(llm)


@pytest.mark.slow
def test_four_ranks_match_one_process(tmp_path: Path) -> None:
    """4 ranks on a random 16-expert config with 3 requests: one rank idles throughout (zero-token
    forwards) and the others finish at different steps."""
    make_hf_checkpoint(tmp_path, seed=4, n_routed_experts=16)
    prompts, params = prompts_for(256, 3, seed=4), params_for(3)
    ref = run_single(tmp_path, prompts, params)
    llm = start(tmp_path, 4)
    try:
        compare(ref, llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert_all_blocks_free(llm)
    finally:
        stop(llm)


def test_rejected_request_is_an_error_and_the_ranks_keep_serving() -> None:
    """A prompt a rank rejects (too long) raises ValueError from generate; the ranks stay usable."""
    llm = start(default_model_path(), 2)
    try:
        with pytest.raises(ValueError, match="context length is 512"):
            llm.generate(prompt_token_ids=[[5] * 600], sampling_params=SamplingParams(max_tokens=2))
        out = llm.generate(
            prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True)
        )
        assert len(out[0].token_ids) == 3
        assert_all_blocks_free(llm)
    finally:
        stop(llm)


def test_live_eplb_moves_experts_while_serving_and_outputs_do_not_change() -> None:
    """Every 3 computing steps the ranks plan a placement from the window's expert load and, when the
    predicted balance rises (threshold 0 here), move expert weights between ranks mid-generation: no
    request is dropped and the tokens and logprobs equal one process's."""
    model = default_model_path()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts, params = prompts_for(vocab, 6, seed=3), params_for(6)
    ref = run_single(model, prompts, params)
    llm = start(model, 2, num_redundant_experts=2, eplb_interval=3, eplb_window=50, eplb_min_gain=0.0)
    try:
        compare(ref, llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert_all_blocks_free(llm)
        stats = llm.engine.collect_stats()
        decisions = stats[0].decisions
        assert decisions == stats[1].decisions, "the ranks took different EPLB decisions"
        applied = [d for d in decisions if d[4]]
        assert applied, f"no rearrangement was applied: {decisions}"
        assert all(after > before and moved > 0 for _, before, after, moved, _ in applied)
    finally:
        stop(llm)
