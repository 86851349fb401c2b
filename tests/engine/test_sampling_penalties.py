"""Penalties from state kept across steps (``PenaltyState``) equal penalties computed from the whole
history every step (vLLM semantics), as a request's output grows, with drafts, and across id reuse."""

from __future__ import annotations

import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.penalties import PenaltyState
from deepinfer.worker.sampler import SamplingRow, _penalise

VOCAB = 50
PARAMS = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)


def from_scratch(logits: torch.Tensor, prompt: list[int], history: list[int]) -> torch.Tensor:
    row = logits.clone()
    seen = torch.tensor(sorted(set(prompt + history)), dtype=torch.int64)
    values = row[seen]
    row[seen] = torch.where(
        values > 0, values / PARAMS.repetition_penalty, values * PARAMS.repetition_penalty
    )
    if history:
        counts = torch.bincount(torch.tensor(history), minlength=VOCAB).float()
        row -= PARAMS.frequency_penalty * counts + PARAMS.presence_penalty * (counts > 0).float()
    return row


def test_incremental_penalties_match_the_whole_history() -> None:
    gen = torch.Generator().manual_seed(0)
    state = PenaltyState()
    prompt = torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    output: list[int] = []
    for step in range(12):
        drafts = torch.randint(0, VOCAB, (step % 3,), generator=gen).tolist()
        rows = [SamplingRow("a", PARAMS, 0, prompt, output, drafts[:j]) for j in range(len(drafts) + 1)]
        logits = torch.randn(len(rows), VOCAB, generator=gen)
        expected = torch.stack(
            [from_scratch(logits[j], prompt, output + drafts[:j]) for j in range(len(rows))]
        )
        _penalise(logits, rows, state)
        torch.testing.assert_close(logits, expected)
        output.append(int(torch.randint(0, VOCAB, (1,), generator=gen)))  # the scheduler's list grows
    # The same id with new lists (a later request reusing it) starts from its own history.
    prompt2, output2 = [1, 2, 3], [4]
    logits = torch.randn(1, VOCAB, generator=gen)
    expected = from_scratch(logits[0], prompt2, output2)
    _penalise(logits, [SamplingRow("a", PARAMS, 0, prompt2, output2)], state)
    torch.testing.assert_close(logits[0], expected)
