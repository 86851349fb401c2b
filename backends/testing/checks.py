"""One check per interface op: run the backend under test and the float32 CPU reference on the same
seeded inputs and compare row by row, with uninitialised memory NaN-filled (see ``harness``). Each
check raises AssertionError with the op, the case and the error.

Checks take the op table explicitly, so they also run against deliberately broken tables (the tests
prove the suite catches wrong kernels).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from deepinfer.backends.quant import WeightFormat
from deepinfer.backends.registry import OpTable
from deepinfer.backends.testing.harness import (
    MLAShape,
    MoEShape,
    assert_close,
    generator,
    nan_filled_memory,
    poison_device_memory,
    randn,
    reference_ops,
)


def _on(x: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    return x.to(device=device, dtype=dtype) if dtype is not None else x.to(device)


def _rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """What the reference sees: the case-dtype values, widened back to float32."""
    return x.to(dtype).float()


@nan_filled_memory()
def check_rms_norm(
    ops: OpTable, device: torch.device, dtype: torch.dtype, hidden: int, case: str, rows: int = 7
) -> None:
    gen = generator(case)
    x, w = randn(gen, rows, hidden), 1 + randn(gen, hidden, scale=0.1)
    res = randn(gen, rows, hidden)
    ref = reference_ops()
    poison_device_memory(device)
    out = ops.rms_norm(_on(x, device, dtype), _on(w, device, dtype), 1e-6)
    assert_close(f"rms_norm[{case}]", out, ref.rms_norm(_rounded(x, dtype), _rounded(w, dtype), 1e-6), dtype)
    normed, summed = ops.add_rms_norm(
        _on(x, device, dtype), _on(res, device, dtype), _on(w, device, dtype), 1e-6
    )
    ref_normed, ref_summed = ref.add_rms_norm(
        _rounded(x, dtype), _rounded(res, dtype), _rounded(w, dtype), 1e-6
    )
    assert_close(f"add_rms_norm.sum[{case}]", summed, ref_summed, dtype)
    assert_close(f"add_rms_norm.norm[{case}]", normed, ref_normed, dtype)


@nan_filled_memory()
def check_silu_and_mul(ops: OpTable, device: torch.device, dtype: torch.dtype, width: int, case: str) -> None:
    x = randn(generator(case), 9, 2 * width)
    poison_device_memory(device)
    out = ops.silu_and_mul(_on(x, device, dtype))
    assert_close(f"silu_and_mul[{case}]", out, reference_ops().silu_and_mul(_rounded(x, dtype)), dtype)


def cos_sin_table(rope_dim: int, max_pos: int, base: float = 10000.0) -> Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@nan_filled_memory()
def check_rope(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MLAShape, interleaved: bool, case: str
) -> None:
    gen = generator(case)
    tokens, max_pos = 11, 4096
    q, k = randn(gen, tokens, shape.heads, shape.rope), randn(gen, tokens, shape.rope)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    table = cos_sin_table(shape.rope, max_pos)
    poison_device_memory(device)
    q_out, k_out = ops.rope(
        _on(q, device, dtype), _on(k, device, dtype), _on(positions, device), _on(table, device), interleaved
    )
    q_ref, k_ref = reference_ops().rope(_rounded(q, dtype), _rounded(k, dtype), positions, table, interleaved)
    assert_close(f"rope.q[{case}]", q_out, q_ref, dtype)
    assert_close(f"rope.k[{case}]", k_out, k_ref, dtype)


class PagedBatch:
    """Requests with random block tables over a poisoned cache, filled through ``ops.kv_cache_write``.

    Blocks not owned by any request hold NaN, so a kernel that reads outside a request's blocks (or
    past its length) produces NaN and fails the comparison.
    """

    def __init__(
        self,
        ops: OpTable,
        device: torch.device,
        dtype: torch.dtype,
        shape: MLAShape,
        seq_lens: list[int],
        gen: torch.Generator,
    ) -> None:
        self.spec = ops.kv_cache_spec(shape.kv_lora_rank, shape.rope, dtype)
        bs = self.spec.block_size
        per_req = [math.ceil(n / bs) for n in seq_lens]
        num_blocks = sum(per_req) + 3
        self.cache = self.spec.allocate(num_blocks, device)
        for t in self.cache:
            t.fill_(float("nan"))
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(per_req)
        # Unused table entries point at a NaN block that belongs to nobody (3 spare blocks exist).
        table = torch.full((len(seq_lens), width), perm[-1], dtype=torch.int32)
        cursor, slots = 0, []
        for b, (n, nb) in enumerate(zip(seq_lens, per_req)):
            blocks = perm[cursor : cursor + nb]
            cursor += nb
            table[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
            slots += [blocks[p // bs] * bs + p % bs for p in range(n)]
        self.block_table = table
        self.slots = torch.tensor(slots, dtype=torch.int64)
        total = len(slots)
        self.latent = randn(gen, total, shape.kv_lora_rank)
        self.rope = randn(gen, total, shape.rope)
        ops.kv_cache_write(
            _on(self.latent, device, dtype),
            _on(self.rope, device, dtype),
            self.cache,
            _on(self.slots, device),
        )


@nan_filled_memory()
def check_kv_cache(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MLAShape, case: str
) -> None:
    gen = generator(case)
    batch = PagedBatch(ops, device, dtype, shape, [5, 37, 1], gen)
    # A padding token (slot -1) must be skipped, not written anywhere.
    ops.kv_cache_write(
        _on(randn(gen, 1, shape.kv_lora_rank), device, dtype),
        _on(randn(gen, 1, shape.rope), device, dtype),
        batch.cache,
        torch.tensor([-1], dtype=torch.int64, device=device),
    )
    order = torch.randperm(batch.slots.numel(), generator=gen)
    poison_device_memory(device)
    kv_c, k_pe = ops.kv_cache_gather(batch.cache, _on(batch.slots[order], device), shape.kv_lora_rank)
    assert_close(f"kv_cache.latent[{case}]", kv_c, _rounded(batch.latent[order], dtype), dtype)
    assert_close(f"kv_cache.rope[{case}]", k_pe, _rounded(batch.rope[order], dtype), dtype)


@nan_filled_memory()
def check_mla_prefill(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MLAShape, window: int | None, case: str
) -> None:
    gen = generator(case)
    q_lens, k_lens = [6, 3, 1, 17], [6, 11, 4, 17]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = shape.nope + shape.rope
    q = randn(gen, sum(q_lens), shape.heads, width)
    k = randn(gen, sum(k_lens), shape.heads, width)
    v = randn(gen, sum(k_lens), shape.heads, shape.v)
    scale = width**-0.5
    poison_device_memory(device)
    out = ops.mla_prefill(
        _on(q, device, dtype),
        _on(k, device, dtype),
        _on(v, device, dtype),
        _on(cu_q, device),
        _on(cu_k, device),
        max(q_lens),
        max(k_lens),
        scale,
        window,
    )
    ref = reference_ops().mla_prefill(
        _rounded(q, dtype),
        _rounded(k, dtype),
        _rounded(v, dtype),
        cu_q,
        cu_k,
        max(q_lens),
        max(k_lens),
        scale,
        window,
    )
    assert_close(f"mla_prefill[{case}]", out, ref, dtype)


@nan_filled_memory()
def check_mla_prefill_partial(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MLAShape, causal: bool, case: str
) -> None:
    """Both outputs (attention and log-sum-exp); without causality, one request has no keys (its rows
    must come back as 0 and -inf)."""
    gen = generator(case)
    q_lens = [6, 3, 1, 17]
    k_lens = [6, 11, 4, 17] if causal else [5, 0, 9, 2]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = shape.nope + shape.rope
    q = randn(gen, sum(q_lens), shape.heads, width)
    k = randn(gen, sum(k_lens), shape.heads, width)
    v = randn(gen, sum(k_lens), shape.heads, shape.v)
    scale = width**-0.5
    args = (max(q_lens), max(k_lens), scale, causal)
    poison_device_memory(device)
    out, lse = ops.mla_prefill_partial(
        _on(q, device, dtype), _on(k, device, dtype), _on(v, device, dtype), _on(cu_q, device),
        _on(cu_k, device), *args,
    )  # fmt: skip
    ref, ref_lse = reference_ops().mla_prefill_partial(
        _rounded(q, dtype), _rounded(k, dtype), _rounded(v, dtype), cu_q, cu_k, *args
    )
    for name, got in (("out", out), ("lse", lse)):
        if got.dtype != torch.float32:
            raise AssertionError(f"mla_prefill_partial.{name}[{case}]: {got.dtype}, expected torch.float32")
    empty = ref_lse == float("-inf")
    lse = lse.cpu()
    if not torch.equal(lse == float("-inf"), empty):
        raise AssertionError(f"mla_prefill_partial.lse[{case}]: -inf exactly where a query has no keys")
    if not bool((out.cpu()[empty] == 0).all()):
        raise AssertionError(f"mla_prefill_partial.out[{case}]: rows of queries without keys must be 0")
    seen = ~empty.all(dim=1)
    assert_close(f"mla_prefill_partial.out[{case}]", out.cpu()[seen], ref[seen], dtype)
    assert_close(f"mla_prefill_partial.lse[{case}]", lse[seen], ref_lse[seen], dtype)


def _contiguous_reference_cache(
    shape: MLAShape, dtype: torch.dtype, seq_lens: list[int], batch: PagedBatch
) -> tuple[tuple[Tensor, ...], Tensor]:
    """The same rows in a float32 reference-layout cache, each request in consecutive blocks."""
    ref_ops = reference_ops()
    spec = ref_ops.kv_cache_spec(shape.kv_lora_rank, shape.rope, torch.float32)
    bs = spec.block_size
    blocks_per_req = [math.ceil(n / bs) for n in seq_lens]
    cache = spec.allocate(sum(blocks_per_req), "cpu")
    table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    first_block, first_row = 0, 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_req)):
        table[b, :nb] = torch.arange(first_block, first_block + nb, dtype=torch.int32)
        rows = slice(first_row, first_row + n)
        slots = first_block * bs + torch.arange(n)
        ref_ops.kv_cache_write(
            _rounded(batch.latent[rows], dtype), _rounded(batch.rope[rows], dtype), cache, slots
        )
        first_block += nb
        first_row += n
    return cache, table


def decode_query_std(shape: MLAShape) -> float:
    """The spread of random decode queries that gives attention logits of unit spread (the cached rows
    are unit normal over L + R dims; the softmax scale is (nope + rope) ** -0.5): attention peaked
    enough that a wrong scale or a wrong key moves an output row well past the bf16 tolerance, where
    near-uniform attention would average such bugs away (queries of spread 0.1 hid a 5% scale error)."""
    return math.sqrt((shape.nope + shape.rope) / (shape.kv_lora_rank + shape.rope))


@nan_filled_memory()
def check_mla_decode(
    ops: OpTable,
    device: torch.device,
    dtype: torch.dtype,
    shape: MLAShape,
    query_lens: list[int],
    window: int | None,
    case: str,
    corrupt_block_table: bool = False,
) -> None:
    """``corrupt_block_table`` shifts one block-table entry of the backend's input (not the
    reference's): a correct kernel then reads a wrong or NaN block and the check must fail."""
    gen = generator(case)
    seq_lens = [9, 70, 33, 130][: len(query_lens)]
    ref_ops = reference_ops()
    batch = PagedBatch(ops, device, dtype, shape, seq_lens, gen)
    ref_cache, ref_table = _contiguous_reference_cache(shape, dtype, seq_lens, batch)
    num_tokens = sum(query_lens)
    q_std = decode_query_std(shape)
    q_nope = randn(gen, num_tokens, shape.heads, shape.kv_lora_rank, scale=q_std)
    q_pe = randn(gen, num_tokens, shape.heads, shape.rope, scale=q_std)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (shape.nope + shape.rope) ** -0.5
    table = batch.block_table.clone()
    if corrupt_block_table:
        row = max(range(len(seq_lens)), key=lambda b: seq_lens[b])
        table[row, 0] = table[row, 1]
    poison_device_memory(device)
    out = ops.mla_decode(
        _on(q_nope, device, dtype),
        _on(q_pe, device, dtype),
        batch.cache,
        _on(table, device),
        _on(lens, device),
        _on(qsl, device),
        max(query_lens),
        scale,
        window,
    )
    ref = ref_ops.mla_decode(
        _rounded(q_nope, dtype),
        _rounded(q_pe, dtype),
        ref_cache,
        ref_table,
        lens,
        qsl,
        max(query_lens),
        scale,
        window,
    )
    assert_close(f"mla_decode[{case}]", out, ref, dtype)


def _sorted_routing(weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    ids, order = ids.long().cpu().sort(dim=-1)
    return weights.float().cpu().gather(1, order), ids


@nan_filled_memory()
def check_moe_route(
    ops: OpTable,
    device: torch.device,
    shape: MoEShape,
    scoring_func: str,
    topk_method: str,
    renormalize: bool,
    case: str,
) -> None:
    gen = generator(case)
    logits = randn(gen, 33, shape.experts)
    bias = randn(gen, shape.experts, scale=0.1) if topk_method == "noaux_tc" else None
    args = (shape.top_k, shape.n_group, shape.topk_group, scoring_func, topk_method, renormalize, 2.5)
    poison_device_memory(device)
    weights, ids = ops.moe_route(_on(logits, device), None if bias is None else _on(bias, device), *args)
    ref_w, ref_ids = reference_ops().moe_route(logits, bias, *args)
    weights, ids = _sorted_routing(weights, ids)
    ref_w, ref_ids = _sorted_routing(ref_w, ref_ids)
    if not torch.equal(ids, ref_ids):
        bad = int((ids != ref_ids).any(dim=-1).sum())
        raise AssertionError(f"moe_route[{case}]: {bad} of {ids.shape[0]} tokens chose different experts")
    assert_close(f"moe_route.weights[{case}]", weights, ref_w, torch.float32)


@nan_filled_memory()
def check_grouped_gemm(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MoEShape, case: str
) -> None:
    gen = generator(case)
    sizes = torch.randint(0, 5, (shape.experts,), generator=gen)
    sizes[0] = 0
    x = randn(gen, int(sizes.sum()), shape.hidden)
    w = randn(gen, shape.experts, shape.intermediate, shape.hidden, scale=shape.hidden**-0.5)
    poison_device_memory(device)
    out = ops.grouped_gemm(_on(x, device, dtype), _on(w, device, dtype), _on(sizes, device))
    ref = reference_ops().grouped_gemm(_rounded(x, dtype), _rounded(w, dtype), sizes)
    assert_close(f"grouped_gemm[{case}]", out, ref, dtype)


def random_routing(gen: torch.Generator, tokens: int, experts: int, top_k: int) -> tuple[Tensor, Tensor]:
    """Distinct experts per token and positive weights."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights, ids.to(torch.int32)


@nan_filled_memory()
def check_fused_moe(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MoEShape, with_remote: bool, case: str
) -> None:
    """``with_remote`` marks some routed experts as owned by another rank (id -1)."""
    gen = generator(case)
    tokens = 13
    hidden = randn(gen, tokens, shape.hidden)
    w13 = randn(gen, shape.experts, 2 * shape.intermediate, shape.hidden, scale=shape.hidden**-0.5)
    w2 = randn(gen, shape.experts, shape.hidden, shape.intermediate, scale=shape.intermediate**-0.5)
    weights, ids = random_routing(gen, tokens, shape.experts, shape.top_k)
    if with_remote:
        ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
    poison_device_memory(device)
    out = ops.fused_moe(
        _on(hidden, device, dtype),
        _on(w13, device, dtype),
        _on(w2, device, dtype),
        _on(weights, device),
        _on(ids, device),
    )
    ref = reference_ops().fused_moe(
        _rounded(hidden, dtype), _rounded(w13, dtype), _rounded(w2, dtype), weights, ids
    )
    assert_close(f"fused_moe[{case}]", out, ref, dtype)


@nan_filled_memory()
def check_ep_single_rank(
    ops: OpTable, device: torch.device, dtype: torch.dtype, shape: MoEShape, case: str
) -> None:
    """Dispatch then combine on one rank, with a known per-expert function in between."""
    gen = generator(case)
    tokens = 10
    hidden = randn(gen, tokens, shape.hidden)
    weights, ids = random_routing(gen, tokens, shape.experts, shape.top_k)
    poison_device_memory(device)
    dispatched = ops.ep_dispatch(
        _on(hidden, device, dtype), _on(ids, device), _on(weights, device), shape.experts, None
    )
    scale = dispatched.local_expert_ids.to(dtype) + 1
    out = ops.ep_combine(dispatched.hidden * scale[:, None], dispatched, None)
    expected = (weights * (ids.float() + 1)).sum(dim=-1, keepdim=True) * _rounded(hidden, dtype)
    assert_close(f"ep_dispatch+combine[{case}]", out, expected, dtype)


@nan_filled_memory()
def check_sample(ops: OpTable, device: torch.device, case: str) -> None:
    gen = generator(case)
    rows, vocab = 16, 1000
    logits = randn(gen, rows, vocab, scale=3.0)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * 4)
    top_k = torch.tensor([0, 0, 50, 0, 1, 0, 20, 0] * 2, dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.8, 0.95] * 2)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.05] * 2)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    offsets = torch.randint(0, 4096, (rows,), generator=gen)
    args = (temperature, top_k, top_p, min_p, seeds, offsets)
    poison_device_memory(device)
    out = ops.sample(_on(logits, device), *(_on(a, device) for a in args))
    ref = reference_ops().sample(logits, *args)
    if out.dtype != torch.int64:
        raise AssertionError(f"sample[{case}]: returned {out.dtype}, expected torch.int64")
    mismatched = (out.cpu() != ref).nonzero().flatten().tolist()
    if mismatched:
        raise AssertionError(f"sample[{case}]: rows {mismatched} drew different tokens than the reference")


@nan_filled_memory()
def check_greedy(ops: OpTable, device: torch.device, vocab: int, case: str) -> None:
    """Bit-exact against the reference: integer-valued logits (many ties, which the lowest index
    wins), rows of -inf but one, a row of -inf only, and rows holding NaN (the first NaN wins)."""
    gen = generator(case)
    logits = torch.randint(-3, 4, (70, vocab), generator=gen).float()
    logits[1] = float("-inf")
    logits[1, vocab - 1] = 0.0
    logits[2] = float("-inf")
    logits[3, vocab // 2] = float("nan")
    logits[4, [vocab // 3, vocab - 2]] = float("nan")
    logits[5, 0] = float("nan")
    logits[6, -1] = 100.0
    poison_device_memory(device)
    out = ops.greedy(_on(logits, device))
    ref = reference_ops().greedy(logits)
    if out.dtype != torch.int64:
        raise AssertionError(f"greedy[{case}]: returned {out.dtype}, expected torch.int64")
    mismatched = (out.cpu() != ref).nonzero().flatten().tolist()
    if mismatched:
        raise AssertionError(f"greedy[{case}]: rows {mismatched} picked other tokens than the reference")


@nan_filled_memory()
def check_apply_token_bitmask(ops: OpTable, device: torch.device, case: str) -> None:
    gen = generator(case)
    rows, vocab = 5, 1000  # not a multiple of 32: the last word is partial
    logits = randn(gen, rows, vocab)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[0] = True
    allowed[1] = False
    allowed[1, vocab - 1] = True  # the very last token, in the partial word
    padded = torch.zeros(rows, 32 * ((vocab + 31) // 32), dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (padded.view(rows, -1, 32).long() * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = _on(logits, device)
    ops.apply_token_bitmask(out, _on(bitmask, device))
    expected = logits.masked_fill(~allowed, float("-inf"))
    if not torch.equal(out.cpu(), expected):
        wrong = int((out.cpu() != expected).sum())
        raise AssertionError(f"apply_token_bitmask[{case}]: {wrong} logits differ from the mask")


# Row counts check_linear covers: a decode batch of one and a few (where backends may take a
# matrix-vector path), eight, and more.
LINEAR_ROWS = (1, 3, 8, 13)


@nan_filled_memory()
def check_linear(
    ops: OpTable, device: torch.device, dtype: torch.dtype, k: int, n: int, heads: int, case: str
) -> None:
    """heads = 0: x [T, K] by weight [N, K] with a bias; heads > 0: per-head x [T, H, K] by [H, N, K].
    For every row count of ``LINEAR_ROWS``, with the weight laid out as loaded (unit stride along K) and
    as the transposed view of a [K, N] matrix (unit stride along N: the D-major LM head, MLA's absorbed
    W_UK), which the model also passes."""
    gen = generator(case)
    if heads:
        xs, w, bias = randn(gen, max(LINEAR_ROWS), heads, k), randn(gen, heads, n, k, scale=k**-0.5), None
    else:
        xs, w, bias = randn(gen, max(LINEAR_ROWS), k), randn(gen, n, k, scale=k**-0.5), randn(gen, n)
    for tokens in LINEAR_ROWS:
        x = xs[:tokens]
        ref = reference_ops().linear(
            _rounded(x, dtype), _rounded(w, dtype), None if bias is None else _rounded(bias, dtype)
        )
        for layout in ("rows", "columns"):
            weight = _on(w, device, dtype)
            if layout == "columns":
                weight = weight.transpose(-1, -2).contiguous().transpose(-1, -2)
            poison_device_memory(device)
            out = ops.linear(
                _on(x, device, dtype), weight, None if bias is None else _on(bias, device, dtype)
            )
            assert_close(f"linear[{case}, {tokens} rows, {layout}]", out, ref, dtype)


# ----------------------------------------------------------------------------------------- quantised weights
# Quantised weights are drawn directly in their format (``quantized_weight``): values spread over the
# format's codes, and block scales whose magnitude alternates like a checkerboard over the scale grid,
# so that neighbouring blocks along N and along K differ at least 4x: a kernel that applies a wrong
# block's scale, one scale for a whole row of blocks, or the grid transposed is far off at every
# dtype's tolerance. The reference gets the very same (values, scale) pairs, on the CPU; only the
# activations are rounded to the case dtype.

# Row counts the quantised linear checks cover per shape (the 4096-row case has its own, small shape).
QUANT_ROWS = (1, 3, 8, 13)


def checkerboard_exponents(
    gen: torch.Generator, lead: tuple[int, ...], rows: int, cols: int, integer: bool
) -> Tensor:
    """float32 [*lead, rows, cols]: u with |u| uniform in [1, 3] (an integer 1, 2 or 3 when
    ``integer``) and its sign alternating like a checkerboard, so 2 ** u differs >= 4x between
    neighbours."""
    parity = (torch.arange(rows)[:, None] + torch.arange(cols)[None, :]) % 2
    if integer:
        size = torch.randint(1, 4, (*lead, rows, cols), generator=gen).float()
    else:
        size = 1 + 2 * torch.rand(*lead, rows, cols, generator=gen)
    return size * (1 - 2 * parity)


def block_magnitudes(
    gen: torch.Generator, lead: tuple[int, ...], n: int, k: int, block: tuple[int, int]
) -> Tensor:
    """float32 [*lead, n, k]: one factor ``2 ** u`` per (bn, bk) block, u from ``checkerboard_exponents``."""
    from deepinfer.backends.quant import expand_scale

    u = checkerboard_exponents(gen, lead, math.ceil(n / block[0]), math.ceil(k / block[1]), False)
    return expand_scale(torch.exp2(u), block, n, k)


def quantized_weight(
    gen: torch.Generator, lead: tuple[int, ...], n: int, k: int, fmt: WeightFormat
) -> tuple[Tensor, Tensor]:
    """A random [*lead, n, k] weight in ``fmt`` (values, scale), on the CPU, whose dequantised entries
    have a spread of about ``k ** -0.5`` times the block's checkerboard factor. fp8: values normal of
    spread 64 (the e4m3 range, subnormals included), scales continuous (f32) or powers of two (ue8m0);
    mxfp4: every byte (so every e2m1 code, -0 included) equally likely, exponents alternating per
    4 rows x 32 columns (so they vary along N too)."""
    if fmt.kind == "mxfp4":
        fmt.values_shape(n, k)  # validates K
        values = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
        tiles = checkerboard_exponents(gen, lead, math.ceil(n / 4), k // 32, True)
        base = round(math.log2(k**-0.5 / 2.9))  # e2m1 codes have a root mean square of 2.9
        exponents = 127 + base + tiles.repeat_interleave(4, dim=-2)[..., :n, :]
        return values, exponents.to(torch.uint8)
    rows, cols = fmt.scale_shape(n, k)
    values = (randn(gen, *lead, n, k) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    u = checkerboard_exponents(gen, lead, rows, cols, fmt.scale_fmt == "ue8m0")
    base = k**-0.5 / 64
    if fmt.scale_fmt == "ue8m0":
        base = 2.0 ** round(math.log2(base))
    return values, (base * torch.exp2(u)).float()


def _expect_dtype(name: str, out: Tensor, dtype: torch.dtype) -> None:
    if out.dtype != dtype:
        raise AssertionError(f"{name}: returned {out.dtype}, expected {dtype}")


def _bits_of(x: Tensor) -> Tensor:
    x = x.detach().cpu().contiguous()
    return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int32)


def _special_groups(x: Tensor, group: int) -> None:
    """Edge cases written into the first groups of x [M, K] (as many as there are): all zeros and all
    tiny (the 1e-4 amax floor), an amax of exactly 448 * 2**-5 (a power-of-two scale, which ue8m0 keeps
    exact), an amax just above 448 * 2**-6 (ue8m0 rounds it up a whole power of two)."""
    m, k = x.shape
    cols = math.ceil(k / group)
    fillers = (
        lambda g: g.zero_(),
        lambda g: g.mul_(1e-7),
        lambda g: g.div_(g.abs().max()).mul_(448 * 2**-5),
        lambda g: g.div_(g.abs().max()).mul_(448 * 2**-6 * 1.01),
    )
    for i, fill in enumerate(fillers[: m * cols]):
        row, col = divmod(i, cols)
        fill(x[row, col * group : (col + 1) * group])


@nan_filled_memory()
def check_quant_fp8_group(
    ops: OpTable,
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    k: int,
    group: int,
    case: str,
    ue8m0_modes: tuple[bool, ...] = (False, True),
) -> None:
    """Bit-exact against the reference (it is a pure function), values and scales, for each of
    ``ue8m0_modes`` (f32 and ue8m0 scales); and, independently of the reference, that every scale is
    max(group amax, 1e-4) / 448 (f32) or a power of two in [that, twice that) (ue8m0)."""
    gen = generator(case)
    x = randn(gen, rows, k) * block_magnitudes(gen, (), rows, k, (1, group))
    _special_groups(x, group)
    x = _rounded(x, dtype)
    cols = math.ceil(k / group)
    padded = x.new_zeros(rows, cols * group)
    padded[:, :k] = x
    exact = padded.view(rows, cols, group).abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    for ue8m0 in ue8m0_modes:
        name = f"quant_fp8_group[{case}, ue8m0={ue8m0}]"
        poison_device_memory(device)
        values, scale = ops.quant_fp8_group(_on(x, device, dtype), group, ue8m0)
        ref_values, ref_scale = reference_ops().quant_fp8_group(x, group, ue8m0)
        _expect_dtype(f"{name}.values", values, torch.float8_e4m3fn)
        _expect_dtype(f"{name}.scale", scale, torch.float32)
        for part, got, want in (("values", values, ref_values), ("scale", scale, ref_scale)):
            if tuple(got.shape) != tuple(want.shape):
                raise AssertionError(
                    f"{name}.{part}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
                )
        if not bool(torch.isfinite(values.float().cpu()).all()) or not bool(
            torch.isfinite(scale.cpu()).all()
        ):
            raise AssertionError(f"{name}: non-finite outputs (unwritten memory or overflow)")
        scale = scale.cpu()
        if ue8m0:
            mantissa, _ = torch.frexp(scale)
            if not bool((mantissa == 0.5).all()):
                raise AssertionError(
                    f"{name}: {int((mantissa != 0.5).sum())} ue8m0 scales are not powers of two"
                )
            if not bool((scale >= exact).all() and (scale < 2 * exact).all()):
                raise AssertionError(
                    f"{name}: ue8m0 scales must be the power of two in [s, 2s) of s = amax / 448"
                )
        elif not torch.equal(scale, exact):
            raise AssertionError(f"{name}: scales differ from max(amax, 1e-4) / 448")
        for part, got, want in (("scale", scale, ref_scale), ("values", values, ref_values)):
            differ = _bits_of(got) != _bits_of(want)
            if bool(differ.any()):
                raise AssertionError(
                    f"{name}.{part}: {int(differ.sum())} elements differ from the reference bits"
                )


def _quant_linear_inputs(
    case: str, fmt: WeightFormat, k: int, n: int, rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [rows, k] (its magnitude changing per group of block[1] columns), weight values and scale, bias [n]."""
    gen = generator(case)
    values, scale = quantized_weight(gen, (), n, k, fmt)
    x = randn(gen, rows, k) * block_magnitudes(gen, (), rows, k, (1, fmt.block[1])).sqrt()
    return x, values, scale, randn(gen, n)


@nan_filled_memory()
def check_fp8_linear(
    ops: OpTable,
    device: torch.device,
    dtype: torch.dtype,
    fmt: WeightFormat,
    k: int,
    n: int,
    rows: tuple[int, ...],
    case: str,
) -> None:
    """W8A16: x in the case dtype by an FP8 [n, k] weight, for every row count of ``rows`` (with a bias;
    the first row count also without)."""
    x_all, values, scale, bias_all = _quant_linear_inputs(case, fmt, k, n, max(rows))
    wv, ws = _on(values, device), _on(scale, device)
    for i, tokens in enumerate(rows):
        x = x_all[:tokens]
        for bias in (bias_all, None) if i == 0 else (bias_all,):
            name = f"fp8_linear[{case}, {tokens} rows, bias={bias is not None}]"
            ref = reference_ops().fp8_linear(
                _rounded(x, dtype), values, scale, fmt.block, None if bias is None else _rounded(bias, dtype)
            )
            poison_device_memory(device)
            out = ops.fp8_linear(
                _on(x, device, dtype), wv, ws, fmt.block, None if bias is None else _on(bias, device, dtype)
            )
            _expect_dtype(name, out, dtype)
            assert_close(name, out, ref, dtype)


@nan_filled_memory()
def check_fp8_linear_w8a8(
    ops: OpTable,
    device: torch.device,
    dtype: torch.dtype,
    fmt: WeightFormat,
    k: int,
    n: int,
    rows: tuple[int, ...],
    case: str,
) -> None:
    """W8A8: activations quantised by the reference ``quant_fp8_group`` (group block[1]; ue8m0 with a
    ue8m0 weight format), output in the case dtype, for every row count of ``rows``."""
    x_all, values, scale, bias_all = _quant_linear_inputs(case, fmt, k, n, max(rows))
    xv_all, xs_all = reference_ops().quant_fp8_group(x_all, fmt.block[1], fmt.scale_fmt == "ue8m0")
    wv, ws = _on(values, device), _on(scale, device)
    for i, tokens in enumerate(rows):
        xv, xs = xv_all[:tokens], xs_all[:tokens]
        for bias in (bias_all, None) if i == 0 else (bias_all,):
            name = f"fp8_linear_w8a8[{case}, {tokens} rows, bias={bias is not None}]"
            ref = reference_ops().fp8_linear_w8a8(
                xv,
                xs,
                values,
                scale,
                fmt.block,
                None if bias is None else _rounded(bias, dtype),
                torch.float32,
            )
            poison_device_memory(device)
            out = ops.fp8_linear_w8a8(
                _on(xv, device), _on(xs, device), wv, ws, fmt.block,
                None if bias is None else _on(bias, device, dtype), dtype,
            )  # fmt: skip
            _expect_dtype(name, out, dtype)
            assert_close(name, out, ref, dtype)


def _group_sizes(gen: torch.Generator, experts: int, rows: int) -> Tensor:
    """int64 [experts]: ``rows`` rows spread at random over experts 1.. (expert 0 gets none)."""
    chosen = (
        torch.randint(1, experts, (rows,), generator=gen)
        if experts > 1
        else torch.zeros(rows, dtype=torch.int64)
    )
    sizes = torch.bincount(chosen, minlength=experts)
    if experts > 1:
        sizes[0] = 0
    return sizes


@nan_filled_memory()
def check_grouped_gemm_quant(
    ops: OpTable,
    device: torch.device,
    dtype: torch.dtype,
    fmt: WeightFormat,
    shape: MoEShape,
    rows: int,
    case: str,
) -> None:
    """``rows`` rows over the experts (some get none) by quantised [E, intermediate, hidden] weights."""
    gen = generator(case)
    sizes = _group_sizes(gen, shape.experts, rows)
    values, scale = quantized_weight(gen, (shape.experts,), shape.intermediate, shape.hidden, fmt)
    x = randn(gen, rows, shape.hidden)
    ref = reference_ops().grouped_gemm_quant(_rounded(x, dtype), values, scale, fmt, sizes)
    poison_device_memory(device)
    out = ops.grouped_gemm_quant(
        _on(x, device, dtype), _on(values, device), _on(scale, device), fmt, _on(sizes, device)
    )
    _expect_dtype(f"grouped_gemm_quant[{case}]", out, dtype)
    assert_close(f"grouped_gemm_quant[{case}]", out, ref, dtype)


@nan_filled_memory()
def check_fused_moe_quant(
    ops: OpTable,
    device: torch.device,
    dtype: torch.dtype,
    fmt: WeightFormat,
    shape: MoEShape,
    tokens: int,
    with_remote: bool,
    case: str,
) -> None:
    """``fused_moe`` with quantised w13 [E, 2I, D] and w2 [E, D, I]; ``with_remote`` marks some routed
    experts as another rank's (id -1)."""
    gen = generator(case)
    e, d, inter = shape.experts, shape.hidden, shape.intermediate
    w13, w13_scale = quantized_weight(gen, (e,), 2 * inter, d, fmt)
    w2, w2_scale = quantized_weight(gen, (e,), d, inter, fmt)
    hidden = randn(gen, tokens, d)
    weights, ids = random_routing(gen, tokens, e, shape.top_k)
    if with_remote:
        ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
    ref = reference_ops().fused_moe_quant(
        _rounded(hidden, dtype), w13, w13_scale, w2, w2_scale, fmt, weights, ids
    )
    poison_device_memory(device)
    out = ops.fused_moe_quant(
        _on(hidden, device, dtype), _on(w13, device), _on(w13_scale, device), _on(w2, device),
        _on(w2_scale, device), fmt, _on(weights, device), _on(ids, device),
    )  # fmt: skip
    _expect_dtype(f"fused_moe_quant[{case}]", out, dtype)
    assert_close(f"fused_moe_quant[{case}]", out, ref, dtype)
