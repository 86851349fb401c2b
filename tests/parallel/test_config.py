"""Parallel configuration: bad values are one-line errors naming the option."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deepinfer.config import EngineConfig
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader import Checkpoint
from deepinfer.model_zoo import default_model_path
from deepinfer.parallel.placement import check_expert_parallel


def model_config() -> ModelConfig:
    return ModelConfig.from_dict(Checkpoint.open(default_model_path()).raw_config)  # 16 routed experts


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(nnodes=2, data_parallel_size=4), "master_addr is required when nnodes > 1"),
        (dict(nnodes=2, node_rank=2, master_addr="10.0.0.1", data_parallel_size=4), "node_rank=2"),
        (dict(nnodes=3, master_addr="10.0.0.1", data_parallel_size=4), "data_parallel_size=4"),
        (dict(num_redundant_experts=2), "num_redundant_experts needs enable_expert_parallel"),
        (dict(eplb_interval=10), "eplb_interval needs enable_expert_parallel"),
        (dict(data_parallel_size=2, speculative="mtp"), "speculative does not combine"),
        (dict(data_parallel_size=2, step_time_budget_ms=50.0), "cost_model='chip'"),
        (dict(data_parallel_size=0), "data_parallel_size"),
    ],
)
def test_bad_engine_options(options, message) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(model="m", **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(data_parallel_size=32), "data_parallel_size=32 exceeds the model's 16 routed experts"),
        (
            dict(data_parallel_size=3),
            r"num_redundant_experts=0 do not divide over data_parallel_size=3; raise num_redundant_experts by 2",
        ),
        (dict(data_parallel_size=3, num_redundant_experts=1), r"raise num_redundant_experts by 1 \(to 2\)"),
    ],
)
def test_experts_that_cannot_be_sharded(options, message) -> None:
    engine = EngineConfig(model="m", enable_expert_parallel=True, **options)
    with pytest.raises(ValueError, match=message) as err:
        check_expert_parallel(model_config(), engine)
    assert "\n" not in str(err.value)


def test_valid_parallel_options() -> None:
    engine = EngineConfig(
        model="m", data_parallel_size=3, enable_expert_parallel=True, num_redundant_experts=2
    )
    check_expert_parallel(model_config(), engine)
    EngineConfig(model="m", data_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1")
