"""The reference sampler at extreme but valid parameter values (a property test), and through the
engine: a temperature or top_p that underflows float32 is greedy, never token id 0."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from deepinfer import LLM, SamplingParams
from deepinfer.backends import ops
from deepinfer.backends.registry import load_backend, set_active_ops
from tests.backends.sampling_support import assert_tokens_in_support, sampling_batches


@settings(max_examples=150, deadline=None)
@given(sampling_batches())
def test_reference_samples_only_supported_tokens(batch: tuple[torch.Tensor, ...]) -> None:
    set_active_ops(load_backend("deepinfer.backends.reference"))
    assert_tokens_in_support(batch, ops.sample(*batch))


def test_underflowing_values_are_greedy_end_to_end() -> None:
    llm = LLM(num_kv_blocks=64)
    prompts = ["def f(x):", "import os\n", "class A:"]
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))]
    assert all(any(t != 0 for t in ids) for ids in greedy)
    for params in (dict(temperature=1e-40), dict(top_p=1e-300), dict(temperature=1e-40, top_p=1e-300)):
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, seed=3, **params))
        assert [o.token_ids for o in outs] == greedy, params


@pytest.mark.parametrize("temperature", [1e-40, 1e-46])
def test_subnormal_temperature_on_huge_logits(temperature: float) -> None:
    logits = torch.tensor([[5.0, 1e4, -1e4, 3.0]])
    args = [torch.tensor([temperature]), torch.tensor([0], dtype=torch.int32), torch.tensor([1.0])]
    token = ops.sample(logits, *args, torch.tensor([0.0]), torch.tensor([1]), torch.tensor([0]))
    assert token.tolist() == [1]
