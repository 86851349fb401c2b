"""The step cost model and the time-budget chunking it drives."""

from __future__ import annotations

import pytest

from deepinfer.engine.cost_model import StepCostModel, attention_pairs
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.model.config import ModelConfig
from deepinfer.platform.chips import CHIPS
from deepinfer.sampling_params import SamplingParams

MODEL = StepCostModel(
    overhead_s=2e-3,
    per_request_s=1e-5,
    per_token_s=1e-4,
    per_attention_s=1e-7,
    per_context_s=3e-6,
    source="test",
)


def test_longer_contexts_and_chunks_cost_more() -> None:
    assert MODEL.predict([(64, 4096)]) > MODEL.predict([(64, 1024)]) > MODEL.predict([(64, 0)])
    assert MODEL.predict([(128, 0)]) > MODEL.predict([(64, 0)])
    assert MODEL.predict([(1, 100)] * 16) > MODEL.predict([(1, 100)] * 8)
    assert attention_pairs(3, 2) == 3 * 2 + 6
    # A chunk pays for expanding its cached context; a lone decode token reads it in the absorbed form.
    assert MODEL.predict([(2, 4096)]) - MODEL.predict([(2, 0)]) > 4096 * MODEL.per_context_s
    assert MODEL.predict([(1, 4096)]) - MODEL.predict([(1, 0)]) < 4096 * MODEL.per_context_s


@pytest.mark.parametrize("cached", [0, 100, 5000, 6600])
def test_largest_chunk_is_the_largest_that_fits(cached: int) -> None:
    seconds = 0.02
    n = MODEL.largest_chunk(cached, seconds, limit=100_000)
    assert MODEL.marginal(n, cached) <= seconds < MODEL.marginal(n + 1, cached)
    assert MODEL.largest_chunk(cached, seconds, limit=7) == min(7, n)
    assert MODEL.largest_chunk(cached, 0.0, limit=100) == 0


def test_fit_recovers_known_coefficients() -> None:
    shapes = [[(n, c)] for n in (16, 64, 256) for c in (0, 512, 2048)] + [
        [(1, c)] * b for b in (1, 8, 32) for c in (128, 1024)
    ]
    fitted = StepCostModel.fit([(w, MODEL.predict(w)) for w in shapes])
    for field in ("overhead_s", "per_token_s", "per_attention_s", "per_context_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(MODEL, field), rel=1e-3)
    assert fitted.source == "calibrated"


def test_chip_model_orders_chips_by_speed() -> None:
    config = ModelConfig.from_dict(dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=163840, n_routed_experts=256, n_shared_experts=1,
        moe_intermediate_size=2048, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
    ))  # fmt: skip
    h200, a100 = (
        StepCostModel.from_chip(CHIPS["sm90"], config),
        StepCostModel.from_chip(CHIPS["sm80"], config),
    )
    assert a100.predict([(4096, 0)]) > h200.predict([(4096, 0)]) > 0


def scheduler(budget_s: float | None, tokens: int = 8192) -> Scheduler:
    config = SchedulerConfig(64, tokens, 32768, tokens, step_time_budget_s=budget_s)
    return Scheduler(config, KVCacheManager(4096, 16, False), MODEL)


def req(rid: str, n: int) -> Request:
    return Request(rid, [7] * n, SamplingParams(max_tokens=64, ignore_eos=True), 0, 64, frozenset(), 0.0)


def run_decodes(s: Scheduler, count: int) -> None:
    for i in range(count):
        s.add_request(req(f"d{i}", 100))
    while any(r.num_output_tokens == 0 for r in s.requests.values()):
        out = s.schedule()
        s.update_from_output(out, {r.request_id: [5] for r in out.requests if r.samples})


def test_time_budget_cuts_a_long_prompt_beside_running_decodes() -> None:
    s = scheduler(budget_s=0.05)
    run_decodes(s, 16)
    s.add_request(req("long", 8192))
    out = s.schedule()
    sizes = {r.request_id: r.num_new_tokens for r in out.requests}
    assert all(sizes[f"d{i}"] == 1 for i in range(16))
    work = [(r.num_new_tokens, r.num_computed_tokens) for r in out.requests]
    assert 0 < sizes["long"] < 8192
    assert MODEL.predict(work) <= 0.05 < MODEL.predict([*work[:-1], (sizes["long"] + 1, 0)])


def test_later_chunks_shrink_as_the_context_grows() -> None:
    s = scheduler(budget_s=0.05)
    s.add_request(req("long", 8192))
    sizes = []
    while s.has_unfinished() and len(sizes) < 40:
        out = s.schedule()
        sizes.append(out.requests[0].num_new_tokens)
        s.update_from_output(out, {r.request_id: [5] for r in out.requests if r.samples})
    assert sizes[0] > sizes[5] > sizes[20]


def test_without_a_budget_chunks_are_fixed_size() -> None:
    s = Scheduler(SchedulerConfig(64, 512, 32768, 512), KVCacheManager(4096, 16, False))
    s.add_request(req("long", 2000))
    assert [s.schedule().requests[0].num_new_tokens for _ in range(4)] == [512, 512, 512, 464]


def test_a_prompt_always_progresses_even_when_nothing_fits() -> None:
    s = scheduler(budget_s=1e-4)  # below the step overhead
    s.add_request(req("p", 500))
    assert s.schedule().requests[0].num_new_tokens == 16


def test_budget_requires_a_cost_model() -> None:
    with pytest.raises(ValueError, match="needs a cost model"):
        Scheduler(SchedulerConfig(8, 64, 512, 64, step_time_budget_s=0.01), KVCacheManager(64, 16, False))


def test_measured_step_times_correct_the_budget() -> None:
    """Steps that take twice their prediction halve what the next chunk may be predicted to cost."""
    s = scheduler(budget_s=0.05)
    s.add_request(req("long", 8192))
    out = s.schedule()
    first = out.requests[0].num_new_tokens
    work = [(first, 0)]
    for _ in range(30):
        s.observe_step_time(out, 2 * MODEL.predict(work))
    assert s.time_scale == pytest.approx(2.0)
    # The scale follows the slow tail, not the mean: 1 step in 5 at 2x leaves it at 2.
    for i in range(60):
        s.observe_step_time(out, (2 if i % 5 == 0 else 1) * MODEL.predict(work))
    assert s.time_scale == pytest.approx(2.0)
    s.update_from_output(out, {})
    nxt = s.schedule().requests[0]
    assert 2 * MODEL.predict([(nxt.num_new_tokens, nxt.num_computed_tokens)]) <= 0.05
    assert 2 * MODEL.predict([(nxt.num_new_tokens + 1, nxt.num_computed_tokens)]) > 0.05
    # Decode-only steps are not shaped by the budget and do not move the scale.
    decodes = scheduler(budget_s=0.05)
    run_decodes(decodes, 4)
    decodes.observe_step_time(decodes.schedule(), 10.0)
    assert decodes.time_scale == 1.0


def test_largest_chunk_after_a_context_whose_read_alone_overruns_the_time_left() -> None:
    # The context's read-back costs more than the time left: no multi-token chunk fits, a lone token
    # (absorbed form, no read-back) still does. (This used to take the square root of a negative
    # number and kill the engine core.)
    model = StepCostModel(0.014, 3e-5, 1e-6, 1e-9, 4e-5, "calibrated")
    assert model.largest_chunk(4000, 0.1, limit=2048) == 1
    assert model.largest_chunk(4000, 1e-6, limit=2048) == 0
    assert model.largest_chunk(10, 0.1, limit=2048) > 1


def test_fit_mean_predicts_the_expected_time_of_noisy_steps() -> None:
    # The same shapes measured many times with right-skewed noise (a shared host): dividing by the
    # measured time (fit) comes out below the mean, the reweighted fit does not.
    import random

    rng = random.Random(0)
    shapes = [[(n, c)] for n in (16, 256) for c in (0, 1024)] + [[(1, 512)] * b for b in (1, 8, 32)]
    samples = [(w, MODEL.predict(w) * rng.lognormvariate(0, 0.4)) for w in shapes for _ in range(200)]
    for w in shapes:
        mean = sum(t for s, t in samples if s == w) / 200
        assert StepCostModel.fit_mean(samples, "served").predict(w) == pytest.approx(mean, rel=0.08)
        assert StepCostModel.fit(samples).predict(w) < 0.92 * mean


def test_concurrent_saves_each_replace_the_whole_file(tmp_path) -> None:
    """Engines calibrating at once (a local cluster's workers) save to one cache file: every read
    between and after the writes must be one writer's complete model, and no temporary is left."""
    import threading

    path = tmp_path / "cost_models" / "cpu.json"
    models = [StepCostModel(1e-3 * (k + 1), 1e-5, 1e-4, 1e-8, 1e-6, "calibrated") for k in range(4)]
    errors: list[BaseException] = []

    def writer(model: StepCostModel) -> None:
        try:
            for _ in range(50):
                model.save(path)
                assert StepCostModel.load(path) in models
        except BaseException as exc:  # collected: an exception in a thread would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert StepCostModel.load(path) in models
    assert [p.name for p in path.parent.iterdir()] == ["cpu.json"]


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch) -> None:
    import os

    path = tmp_path / "cpu.json"
    old = StepCostModel(1e-3, 1e-5, 1e-4, 1e-8, 1e-6, "calibrated")
    old.save(path)

    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        StepCostModel(2e-3, 1e-5, 1e-4, 1e-8, 1e-6, "calibrated").save(path)
    assert StepCostModel.load(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["cpu.json"]
