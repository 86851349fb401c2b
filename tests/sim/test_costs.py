"""Roofline cost models at DeepSeek-V3 sizes, per chip."""

import pytest

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.platform.chips import sku_facts
from deepinfer.sim.costs import DEEPSEEK_V3, CalibratedCost, RooflineCost


def test_deepseek_v3_sizes() -> None:
    # ~37 B active parameters per token: the dense part plus 8 routed experts in 58 MoE layers.
    active = DEEPSEEK_V3.dense_params + DEEPSEEK_V3.moe_layers * 8 * DEEPSEEK_V3.expert_params
    assert 36e9 < active < 39e9
    assert DEEPSEEK_V3.kv_bytes_per_token == 61 * 576 * 2


@pytest.mark.parametrize("chip", ["gb200", "b200", "h200", "ascend950pr", "ascend950dt"])
def test_decode_steps_grow_with_batch_and_context(chip: str) -> None:
    cost = RooflineCost(sku_facts(chip), ep=64)
    small = cost.step_seconds([[(1, 2048)] * 16])
    assert cost.step_seconds([[(1, 2048)] * 128]) > small
    assert cost.step_seconds([[(1, 32768)] * 16]) > small
    assert cost.kv_capacity_tokens() > 0


def test_faster_chips_are_faster() -> None:
    work = [[(4096, 0)]]
    assert RooflineCost(sku_facts("gb200"), ep=8).step_seconds(work) < RooflineCost(
        sku_facts("h200"), ep=8
    ).step_seconds(work)


def test_all_to_all_beyond_the_scale_up_domain_costs_more() -> None:
    # H200: 8 GPUs per NVLink domain; EP64 sends most tokens over 400 Gb/s NICs. GB200 NVL72 keeps EP64 on NVLink.
    work = [[(1, 4096)] * 128]
    h200 = RooflineCost(sku_facts("h200"), ep=64, overlap=False)
    gb200 = RooflineCost(sku_facts("gb200"), ep=64, overlap=False)
    assert h200.moe_seconds(128 * 64, 128) > 3 * gb200.moe_seconds(128 * 64, 128)
    assert RooflineCost(sku_facts("h200"), ep=64).step_seconds(work) <= h200.step_seconds(
        work
    )  # overlap hides


def test_expert_imbalance_slows_the_moe_layers() -> None:
    even = RooflineCost(sku_facts("gb200"), ep=64)
    skewed = RooflineCost(sku_facts("gb200"), ep=64, expert_imbalance=2.0)
    assert skewed.moe_seconds(8192 * 64, 8192) > 1.5 * even.moe_seconds(8192 * 64, 8192)


def test_prefill_after_a_long_context_absorbs() -> None:
    cost = RooflineCost(sku_facts("gb200"), ep=8)
    # A short chunk after a long cached context costs far less than recomputing that context.
    assert cost.step_seconds([[(512, 65536)]]) < 0.2 * cost.step_seconds([[(65536 + 512, 0)]])


def test_bad_deployments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="more than its 141 GB of HBM"):
        RooflineCost(sku_facts("h200"), ep=1)  # 671 B parameters do not fit one chip
    with pytest.raises(ValueError, match="do not split evenly"):
        RooflineCost(sku_facts("gb200"), ep=64, redundant_experts=32)
    with pytest.raises(ValueError, match="max/mean"):
        RooflineCost(sku_facts("gb200"), ep=8, expert_imbalance=0.5)
    with pytest.raises(KeyError, match="known chips"):
        sku_facts("h300")


def test_the_scheduler_gets_a_model_fitted_to_the_roofline() -> None:
    cost = RooflineCost(sku_facts("gb200"), ep=64)
    model = cost.scheduler_model()
    for work in ([(4096, 0)], [(1, 8192)] * 64):
        assert model.predict(work) == pytest.approx(cost.step_seconds([work]), rel=0.5)


def test_calibrated_cost_keeps_the_schedulers_model_apart_from_the_served_step() -> None:
    model = StepCostModel(1e-3, 1e-4, 1e-5, 1e-8, 1e-7, "calibrated")
    step = StepCostModel(3e-3, 2e-4, 1e-5, 1e-8, 1e-7, "served steps")
    runner = StepCostModel(2e-3, 1e-4, 1e-5, 1e-8, 1e-7, "served steps")
    cost = CalibratedCost(model, step, runner)
    work = [(100, 0), (1, 500)]
    assert cost.scheduler_model() is model
    assert cost.step_seconds([work]) == pytest.approx(step.predict(work))
    assert cost.runner_seconds([work]) == pytest.approx(runner.predict(work))
    alone = CalibratedCost(model)  # the start-up calibration stands for all three
    assert alone.step_seconds([work]) == alone.runner_seconds([work]) == pytest.approx(model.predict(work))
