"""The Triton sampler draws exactly the reference's tokens, including where the filters meet ties."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.reference import sampling as ref
from tests.nvidia.conftest import DEVICE

triton = pytest.importorskip("triton")
tl = triton.language

from deepinfer.ops_cuda.sampling import counter_uniform_tile, row_keys  # noqa: E402  (needs triton)


@triton.jit
def _noise_kernel(key_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(key_ptr + row).to(tl.uint32)
    tl.store(out_ptr + row * V + cols, counter_uniform_tile(key, cols), mask=cols < V)


def test_noise_is_bit_exact_with_counter_uniform() -> None:
    gen = torch.Generator().manual_seed(7)
    seeds = torch.cat(
        (torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen), torch.tensor([0, -1, 2**63 - 1]))
    )
    offsets = torch.randint(0, 2**40, (seeds.numel(),), generator=gen)
    vocab = 3000
    out = torch.empty(seeds.numel(), vocab, device=DEVICE)
    _noise_kernel[(seeds.numel(), triton.cdiv(vocab, 1024))](
        row_keys(seeds, offsets).to(DEVICE), out, vocab, BLOCK=1024
    )
    expected = ref.counter_uniform(seeds, offsets, vocab)
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))


def _params(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.5])[torch.randint(0, 4, (rows,), generator=gen)]
    top_k = torch.tensor([0, 1, 3, 40, 10**6], dtype=torch.int32)[torch.randint(0, 5, (rows,), generator=gen)]
    top_p = torch.tensor([1.0, 0.999, 0.7, 0.2, 0.0])[torch.randint(0, 5, (rows,), generator=gen)]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.3])[torch.randint(0, 4, (rows,), generator=gen)]
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    offsets = torch.randint(0, 10**6, (rows,), generator=gen)
    return temperature, top_k, top_p, min_p, seeds, offsets


@pytest.mark.parametrize(
    "kind",
    ["normal", "ties", "masked", "flat"],
    ids=["random", "bf16-ties", "mostly-minus-inf", "flat"],
)
def test_sample_matches_reference(cuda_ops, kind: str) -> None:
    """Ties between probabilities (bf16 logits), vocabularies that are mostly -inf (constrained
    decoding), a flat distribution (top-p cuts deep), several chunks per row (vocab 1100)."""
    gen = torch.Generator().manual_seed(len(kind))
    rows, vocab = 24, 1100
    logits = torch.randn(rows, vocab, generator=gen) * 3
    if kind == "ties":
        logits = (logits * 4).round() / 4  # few distinct values: long runs of equal probabilities
    elif kind == "masked":
        logits[torch.rand(rows, vocab, generator=gen) < 0.995] = float("-inf")
        logits[:, 7] = 0.5  # every row keeps at least one finite logit
    elif kind == "flat":
        logits = logits * 1e-3
    params = _params(rows, gen)
    out = cuda_ops.sample(logits.to(DEVICE), *(p.to(DEVICE) for p in params))
    expected = ref.sample(logits, *params)
    assert out.dtype == torch.int64
    mismatched = (out.cpu() != expected).nonzero().flatten().tolist()
    assert not mismatched, f"rows {mismatched} differ: {out.cpu()[mismatched]} vs {expected[mismatched]}"


def test_top_k_ties_take_the_lowest_ids(cuda_ops) -> None:
    """Eight equal logits, top_k 3: only ids 0..2 of the tied run may be drawn, whatever the seed."""
    rows = 24
    logits = torch.zeros(rows, 8)
    temperature = torch.ones(rows)
    top_k = torch.full((rows,), 3, dtype=torch.int32)
    top_p, min_p = torch.ones(rows), torch.zeros(rows)
    seeds, offsets = torch.arange(rows), torch.zeros(rows, dtype=torch.int64)
    args = (temperature, top_k, top_p, min_p, seeds, offsets)
    out = cuda_ops.sample(logits.to(DEVICE), *(a.to(DEVICE) for a in args)).cpu()
    assert set(out.tolist()) == {0, 1, 2}
    assert torch.equal(out, ref.sample(logits, *args))
