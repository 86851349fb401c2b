"""deepinfer matches the peer implementation (transformers' DeepseekV3ForCausalLM) in float32.

A batch of prompts of different lengths runs together, with a small step budget so that prompts are
chunked and share steps with decodes. Every logit deepinfer computes (prompt positions and each decode
step) is compared with transformers run teacher-forced on the same tokens, and greedy generation of 32
tokens must be identical to ``transformers.generate``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.model.hf_models import CONFIGS, make_hf_checkpoint
from tests.model.stepping import greedy_steps_with_logits

PROMPT_LENS = [5, 23, 40, 9]
NEW_TOKENS = 32


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_match_transformers(name: str, tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path, **CONFIGS[name])
    batch = prompts(hf.config.vocab_size)
    llm = LLM(str(tmp_path), max_num_batched_tokens=32, num_kv_blocks=64)

    logits_at = greedy_steps_with_logits(llm.engine, batch, 8)
    worst = 0.0
    for i, ids in enumerate(batch):
        ours = logits_at[f"p{i}"]
        full = ids + [int(ours[p].argmax()) for p in range(len(ids) - 1, len(ids) + 7)]
        with torch.no_grad():
            ref = hf(torch.tensor([full[:-1]])).logits[0]
        positions = sorted(ours)
        assert positions == list(range(len(full) - 1)), "every position's logits were computed once"
        got = torch.stack([ours[p] for p in positions])
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    assert worst < 1e-4, f"{name}: max relative logit error {worst:.2e}"

    # Run again through the public API (now also through the prefix cache the first run filled).
    outputs = llm.generate(
        prompt_token_ids=batch,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    for ids, out in zip(batch, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(ids) :
            ]
        assert out.token_ids == expected.tolist(), (
            f"{name}: greedy tokens differ for a {len(ids)}-token prompt"
        )
