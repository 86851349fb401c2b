"""A property shared by the backends' sampling tests: at any valid parameter values, however extreme,
``ops.sample`` only draws tokens the filtered distribution gives non-zero probability."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from deepinfer.backends import ops

# Valid SamplingParams values at and beyond what float32 represents (1e-40 is a float32 subnormal,
# 1e-300 and 1e-46 round to 0 in float32).
TEMPERATURES = [0.0, 1e-300, 1e-46, 1e-40, 1e-38, 1e-20, 1e-6, 1e-5, 3e-5, 0.3, 1.0, 100.0]
TOP_PS = [1e-300, 1e-46, 1e-40, 1e-10, 1e-3, 0.3, 0.9, 1.0]
MIN_PS = [0.0, 1e-300, 1e-40, 1e-6, 0.5, 1.0]


@st.composite
def sampling_batches(draw: st.DrawFn, max_rows: int = 6, max_vocab: int = 300) -> tuple[torch.Tensor, ...]:
    """(logits, temperature, top_k, top_p, min_p, seeds, offsets) with extreme values."""
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(2, max_vocab))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3]))
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if draw(st.booleans()):  # ties, as bf16 logits have
        logits = logits.to(torch.bfloat16).float()
    if draw(st.booleans()):  # structured outputs: most tokens forbidden, at least one allowed
        banned = torch.rand(rows, vocab, generator=gen) < 0.9
        banned[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = False
        logits[banned] = float("-inf")
    pick = lambda values: torch.tensor(draw(st.lists(st.sampled_from(values), min_size=rows, max_size=rows)))  # noqa: E731
    temperature = pick(TEMPERATURES).float()
    top_k = pick([0, 1, 2, 5, vocab, vocab + 3]).int()
    top_p = pick(TOP_PS).float()
    min_p = pick(MIN_PS).float()
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    offsets = torch.randint(0, 2**40, (rows,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds, offsets


def assert_tokens_in_support(batch: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> None:
    """Every sampled token has a finite logit (non-zero probability), passes top-k and min-p, and is
    within the top-p nucleus; where the parameters leave one choice (temperature below
    ``MIN_SAMPLING_TEMPERATURE``, top_k 1, a nucleus smaller than any token) it is a most likely token."""
    logits, temperature, top_k, top_p, min_p, *_ = (t.cpu() for t in batch)
    tokens = tokens.cpu()
    vocab = logits.shape[1]
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    for i, token in enumerate(tokens.tolist()):
        row = logits[i].double()
        assert 0 <= token < vocab and torch.isfinite(row[token]), (i, token)
        # compared as the op compares: a float32 tensor against the threshold, which rounds it to float32
        # (1e-5 in float32 is 9.99999997e-06: in double precision that value is below 1e-5, in float32 not)
        greedy = bool(temperature[i] < ops.MIN_SAMPLING_TEMPERATURE)
        if greedy or int(top_k[i]) == 1 or float(top_p[i]) < 1e-6:
            if greedy:
                assert row[token] == row.max(), (i, token, float(temperature[i]), float(top_p[i]))
            else:
                # most likely up to float32 resolution: at a high temperature near-equal logits give
                # probabilities a few ulps apart (ratio exp(-gap) within 1e-6 of 1), which float32 cannot order
                gap = float((row.max() - row[token]) / float(temperature[i]))
                assert gap <= 1e-6, (i, token, float(temperature[i]), float(top_p[i]), gap)
            continue
        if int(top_k[i]) > 0:
            assert int((row > row[token]).sum()) < int(top_k[i])
        probs = torch.softmax(row / float(temperature[i]), dim=-1)
        assert probs[token] >= float(min_p[i]) * probs.max() * (1 - 1e-4)
        if int(top_k[i]) <= 0 or int(top_k[i]) >= vocab:
            assert float(probs[probs > probs[token]].sum()) < float(top_p[i]) + 1e-4
