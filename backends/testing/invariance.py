"""Batch-invariance checks: each op, as deterministic mode runs it, gives a row the same bits alone
and inside larger, different batches (the declaration ``OpTable.invariance`` makes, checked).

A "row" is a token for the row-wise ops, a (token, expert) group member for ``grouped_gemm``, a request
for ``mla_prefill`` and ``mla_prefill_partial``, and a query token for ``mla_decode``, which must also give a query token the same
bits computed alone (decode) or among its request's other new tokens (a prompt chunk, a speculative
verification). Each check computes the needle alone, then among 1, 7 and 31 random batch mates at a
random position, and compares bit for bit; it also compares the deterministic formulation with the
reference (the usual tolerance), so an invariant but wrong formulation fails too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from deepinfer.backends.quant import WeightFormat
from deepinfer.backends.registry import OpTable
from deepinfer.backends.testing.harness import (
    MLAShape,
    MoEShape,
    assert_close,
    generator,
    quant_moe,
    randn,
    reference_ops,
)

MATES = (1, 7, 31)


class Deterministic:
    """An op table's ops as deterministic mode runs them (``table.op(...)``)."""

    def __init__(self, table: OpTable) -> None:
        self.table = table

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return self.table.deterministic_implementation(name)


def _bits(x: Tensor) -> Tensor:
    x = x.detach().cpu()
    if x.is_floating_point():
        return x.view({1: torch.uint8, 2: torch.int16}.get(x.element_size(), torch.int32))
    return x


def _bits_equal(name: str, alone: Tensor, inside: Tensor, detail: str) -> None:
    a, b = _bits(alone), _bits(inside)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{name}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
    if not torch.equal(a, b):
        raise AssertionError(f"{name}: not batch-invariant ({detail}): {int((a != b).sum())} elements differ")


def _placements(gen: torch.Generator) -> list[tuple[int, int]]:
    """(mates, needle position) for each batch the needle is tried in."""
    return [(m, int(torch.randint(0, m + 1, (1,), generator=gen))) for m in MATES]


def _rowwise(
    name: str,
    fn: Callable[..., Any],
    needle: Sequence[Tensor],
    mates: Callable[[int], Sequence[Tensor]],
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype | None,
    extra: tuple = (),
) -> Any:
    """Row-wise op ``fn(*row_args, *extra)``: row args stacked along dim 0; the needle is row args of one
    row. Returns the needle-alone output (the first, if several)."""

    def on(x: Tensor) -> Tensor:
        return x.to(device, dtype) if (dtype is not None and x.is_floating_point()) else x.to(device)

    def outputs(result: Any) -> tuple[Tensor, ...]:
        return result if isinstance(result, tuple) else (result,)

    alone = outputs(fn(*(on(x) for x in needle), *extra))
    for count, pos in _placements(gen):
        others = mates(count)
        batch = [torch.cat((o[:pos], n, o[pos:])) for n, o in zip(needle, others)]
        inside = outputs(fn(*(on(x) for x in batch), *extra))
        for i, (a, b) in enumerate(zip(alone, inside)):
            _bits_equal(f"{name}.out{i}", a, b[pos : pos + a.shape[0]], f"{count} mates, needle at {pos}")
    return alone[0]


def check_rowwise_small_ops(
    table: OpTable, device: torch.device, dtype: torch.dtype, hidden: int, case: str
) -> None:
    """rms_norm, add_rms_norm, silu_and_mul, linear (2-D and per-head)."""
    ops, gen, oracle = Deterministic(table), generator(case), reference_ops()
    w = (1 + randn(gen, hidden, scale=0.1)).to(device, dtype)
    w_ref = w.float().cpu()

    def rounded(xs: Sequence[Tensor]) -> list[Tensor]:
        return [x.to(dtype).float() for x in xs]

    needle = [randn(gen, 1, hidden)]
    got = _rowwise(
        "rms_norm", ops.rms_norm, needle, lambda m: [randn(gen, m, hidden)], gen, device, dtype, (w, 1e-6)
    )
    assert_close(
        f"rms_norm(deterministic)[{case}]", got, oracle.rms_norm(*rounded(needle), w_ref, 1e-6), dtype
    )
    needle = [randn(gen, 1, hidden), randn(gen, 1, hidden)]
    got = _rowwise(
        "add_rms_norm",
        ops.add_rms_norm,
        needle,
        lambda m: [randn(gen, m, hidden), randn(gen, m, hidden)],
        gen, device, dtype, (w, 1e-6),
    )  # fmt: skip
    want = oracle.add_rms_norm(*rounded(needle), w_ref, 1e-6)[0]
    assert_close(f"add_rms_norm(deterministic)[{case}]", got, want, dtype)
    needle = [randn(gen, 1, 2 * hidden)]
    got = _rowwise(
        "silu_and_mul", ops.silu_and_mul, needle, lambda m: [randn(gen, m, 2 * hidden)], gen, device, dtype
    )
    assert_close(f"silu_and_mul(deterministic)[{case}]", got, oracle.silu_and_mul(*rounded(needle)), dtype)
    out_features = 3 * hidden // 2
    weight = randn(gen, out_features, hidden, scale=hidden**-0.5).to(device, dtype)
    bias = randn(gen, out_features).to(device, dtype)
    x = randn(gen, 1, hidden)
    got = _rowwise(
        "linear", ops.linear, [x], lambda m: [randn(gen, m, hidden)], gen, device, dtype, (weight, bias)
    )
    ref = reference_ops().linear(x.to(dtype).float(), weight.float().cpu(), bias.float().cpu())
    assert_close(f"linear(deterministic)[{case}]", got, ref, dtype)
    heads = 4
    w_heads = randn(gen, heads, 32, hidden, scale=hidden**-0.5).to(device, dtype)
    x = randn(gen, 1, heads, hidden)
    got = _rowwise(
        "linear.per_head",
        ops.linear,
        [x],
        lambda m: [randn(gen, m, heads, hidden)],
        gen,
        device,
        dtype,
        (w_heads, None),
    )
    ref = reference_ops().linear(x.to(dtype).float(), w_heads.float().cpu(), None)
    assert_close(f"linear.per_head(deterministic)[{case}]", got, ref, dtype)


def check_rope(table: OpTable, device: torch.device, dtype: torch.dtype, shape: MLAShape, case: str) -> None:
    from deepinfer.backends.testing.checks import cos_sin_table

    ops, gen = Deterministic(table), generator(case)
    cache = cos_sin_table(shape.rope, 4096).to(device)

    def rows(m: int) -> list[Tensor]:
        return [
            randn(gen, m, shape.heads, shape.rope),
            randn(gen, m, shape.rope),
            torch.randint(0, 4096, (m,), generator=gen),
        ]

    needle = rows(1)
    got = _rowwise("rope", ops.rope, needle, rows, gen, device, dtype, (cache, True))
    q, k, positions = needle
    want = reference_ops().rope(q.to(dtype).float(), k.to(dtype).float(), positions, cache.cpu(), True)[0]
    assert_close(f"rope(deterministic)[{case}]", got, want, dtype)


def check_moe(table: OpTable, device: torch.device, dtype: torch.dtype, shape: MoEShape, case: str) -> None:
    """moe_route, grouped_gemm, fused_moe and ep_dispatch + ep_combine on one rank."""
    from deepinfer.backends.testing.checks import random_routing

    ops, gen = Deterministic(table), generator(case)
    e, d, inter = shape.experts, shape.hidden, shape.intermediate
    bias = randn(gen, e, scale=0.1).to(device)
    route = (bias, shape.top_k, shape.n_group, shape.topk_group, "sigmoid", "noaux_tc", True, 2.5)
    _rowwise(
        "moe_route", ops.moe_route, [randn(gen, 1, e)], lambda m: [randn(gen, m, e)], gen, device, None, route
    )

    w13 = randn(gen, e, 2 * inter, d, scale=d**-0.5).to(device, dtype)
    w2 = randn(gen, e, d, inter, scale=inter**-0.5).to(device, dtype)

    def routed(m: int) -> list[Tensor]:
        weights, ids = random_routing(gen, m, e, shape.top_k)
        return [randn(gen, m, d), weights, ids]

    needle = routed(1)
    got = _rowwise(
        "fused_moe", lambda h, w, i: ops.fused_moe(h, w13, w2, w, i), needle, routed, gen, device, dtype
    )
    ref = reference_ops().fused_moe(
        needle[0].to(dtype).float(), w13.float().cpu(), w2.float().cpu(), needle[1], needle[2]
    )
    assert_close(f"fused_moe(deterministic)[{case}]", got, ref, dtype)

    def dispatch_combine(h: Tensor, w: Tensor, i: Tensor) -> Tensor:
        sent = ops.ep_dispatch(h, i, w, e, None)
        return ops.ep_combine(sent.hidden * (sent.local_expert_ids.to(h.dtype) + 1)[:, None], sent, None)

    _rowwise("ep_dispatch+ep_combine", dispatch_combine, needle, routed, gen, device, dtype)

    # grouped_gemm: the needle row in expert g, mates spread over all experts (rows sorted by expert).
    g = int(torch.randint(0, e, (1,), generator=gen))
    x_needle = randn(gen, 1, d)
    w = w13[:, :inter]
    alone_sizes = torch.zeros(e, dtype=torch.int64)
    alone_sizes[g] = 1
    alone = ops.grouped_gemm(x_needle.to(device, dtype), w, alone_sizes.to(device))
    for count in MATES:
        groups = torch.randint(0, e, (count,), generator=gen)
        mates = randn(gen, count, d)
        rows = torch.cat((x_needle, mates))
        order = torch.argsort(torch.cat((torch.tensor([g]), groups)), stable=True)
        sizes = torch.bincount(torch.cat((torch.tensor([g]), groups)), minlength=e)
        out = ops.grouped_gemm(rows[order].to(device, dtype), w, sizes.to(device))
        pos = int((order == 0).nonzero())
        _bits_equal("grouped_gemm", alone, out[pos : pos + 1], f"{count} mates, needle at {pos}")
    assert_close(
        f"grouped_gemm(deterministic)[{case}]",
        alone,
        reference_ops().grouped_gemm(x_needle.to(dtype).float(), w.float().cpu(), alone_sizes),
        dtype,
    )


def check_sample_and_mask(table: OpTable, device: torch.device, case: str) -> None:
    ops, gen = Deterministic(table), generator(case)
    vocab = 1000

    def rows(m: int) -> list[Tensor]:
        return [
            randn(gen, m, vocab, scale=3.0),
            torch.rand(m, generator=gen) + 0.2,
            torch.randint(0, 50, (m,), generator=gen, dtype=torch.int32),
            torch.rand(m, generator=gen) * 0.5 + 0.5,
            torch.rand(m, generator=gen) * 0.1,
            torch.randint(-(2**62), 2**62, (m,), generator=gen),
            torch.randint(0, 4096, (m,), generator=gen),
        ]

    _rowwise("sample", ops.sample, rows(1), rows, gen, device, None)
    _rowwise(
        "greedy", ops.greedy, [randn(gen, 1, vocab)], lambda m: [randn(gen, m, vocab)], gen, device, None
    )

    def masked(logits: Tensor, bitmask: Tensor) -> Tensor:
        out = logits.clone()
        ops.apply_token_bitmask(out, bitmask)
        return out

    def mask_rows(m: int) -> list[Tensor]:
        return [
            randn(gen, m, vocab),
            torch.randint(-(2**31), 2**31, (m, (vocab + 31) // 32), generator=gen, dtype=torch.int32),
        ]

    _rowwise("apply_token_bitmask", masked, mask_rows(1), mask_rows, gen, device, None)


def check_attention(
    table: OpTable, device: torch.device, dtype: torch.dtype, shape: MLAShape, window: int | None, case: str
) -> None:
    """mla_decode: a query token alone (decode), among its request's other new tokens (chunk or
    verification) and among other requests; mla_prefill: a request alone and among other requests;
    kv_cache_write / kv_cache_gather on the way."""
    from deepinfer.backends.testing.checks import PagedBatch, decode_query_std

    ops, gen = Deterministic(table), generator(case)
    lens = [int(x) for x in torch.randint(1, 150, (32,), generator=gen)]
    lens[0] = 133  # the needle request
    batch = PagedBatch(ops, device, dtype, shape, lens, gen)
    scale, q_std = (shape.nope + shape.rope) ** -0.5, decode_query_std(shape)
    chunk = 9  # the needle's last 9 tokens as new queries
    q_nope = randn(gen, chunk, shape.heads, shape.kv_lora_rank, scale=q_std)
    q_pe = randn(gen, chunk, shape.heads, shape.rope, scale=q_std)

    def decode(req: list[int], seq: list[int], queries: list[int], qn: Tensor, qp: Tensor) -> Tensor:
        qsl = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
        return ops.mla_decode(
            qn.to(device, dtype),
            qp.to(device, dtype),
            batch.cache,
            batch.block_table[req].to(device),
            torch.tensor(seq, dtype=torch.int32, device=device),
            qsl.to(device),
            max(queries),
            scale,
            window,
        )

    # kv_cache_write / kv_cache_gather move rows without arithmetic: the bits come back unchanged.
    kv_c, k_pe = ops.kv_cache_gather(batch.cache, batch.slots.to(device), shape.kv_lora_rank)
    _bits_equal("kv_cache_gather.latent", kv_c, batch.latent.to(dtype), "rows written in one batch")
    _bits_equal("kv_cache_gather.rope", k_pe, batch.rope.to(dtype), "rows written in one batch")

    # The needle's query token i alone (seq_len = its position + 1) vs the 9-token chunk.
    full = decode([0], [lens[0]], [chunk], q_nope, q_pe)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    default = table.default_implementation("mla_decode")(
        q_nope.to(device, dtype), q_pe.to(device, dtype), batch.cache, batch.block_table[:1].to(device),
        torch.tensor([lens[0]], dtype=torch.int32, device=device), qsl, chunk, scale, window,
    )  # fmt: skip
    assert_close(f"mla_decode(deterministic)[{case}]", full, default, dtype)
    for i in (0, 4, chunk - 1):
        single = decode([0], [lens[0] - chunk + 1 + i], [1], q_nope[i : i + 1], q_pe[i : i + 1])
        _bits_equal("mla_decode", single, full[i : i + 1], f"query {i} alone vs in its {chunk}-token chunk")
    # ... and the chunk among other requests decoding one token each (random mates and order).
    for count in MATES:
        mates = torch.randperm(31, generator=gen)[:count] + 1
        pos = int(torch.randint(0, count + 1, (1,), generator=gen))
        reqs = mates.tolist()
        reqs.insert(pos, 0)
        queries = [chunk if r == 0 else 1 for r in reqs]
        qn = torch.cat(
            [q_nope if r == 0 else randn(gen, 1, shape.heads, shape.kv_lora_rank, scale=q_std) for r in reqs]
        )
        qp = torch.cat(
            [q_pe if r == 0 else randn(gen, 1, shape.heads, shape.rope, scale=q_std) for r in reqs]
        )
        out = decode(reqs, [lens[r] for r in reqs], queries, qn, qp)
        _bits_equal("mla_decode", full, out[pos : pos + chunk], f"{count} mates, needle at {pos}")

    # mla_prefill: the needle request (chunk of 9 queries over 30 keys) alone and among others.
    width = shape.nope + shape.rope

    def prefill_rows(q_len: int, k_len: int) -> tuple[Tensor, Tensor, Tensor]:
        return (
            randn(gen, q_len, shape.heads, width),
            randn(gen, k_len, shape.heads, width),
            randn(gen, k_len, shape.heads, shape.v),
        )

    def prefill(parts: list[tuple[Tensor, Tensor, Tensor]], causal: bool | None) -> tuple[Tensor, ...]:
        """mla_prefill (causal None) or mla_prefill_partial(causal) over the parts, as a tuple."""
        cu_q = torch.tensor(
            [0, *torch.tensor([p[0].shape[0] for p in parts]).cumsum(0).tolist()], dtype=torch.int32
        )
        cu_k = torch.tensor(
            [0, *torch.tensor([p[1].shape[0] for p in parts]).cumsum(0).tolist()], dtype=torch.int32
        )
        q, k, v = (torch.cat([p[i] for p in parts]).to(device, dtype) for i in range(3))
        lens = (max(p[0].shape[0] for p in parts), max(p[1].shape[0] for p in parts))
        if causal is None:
            return (ops.mla_prefill(q, k, v, cu_q.to(device), cu_k.to(device), *lens, width**-0.5, window),)
        return ops.mla_prefill_partial(q, k, v, cu_q.to(device), cu_k.to(device), *lens, width**-0.5, causal)

    needle = prefill_rows(9, 30)
    # mla_prefill_partial has no window: checked once, in the window=None case.
    for causal in (None,) if window is not None else (None, True, False):
        name = "mla_prefill" if causal is None else f"mla_prefill_partial(causal={causal})"
        alone = prefill([needle], causal)
        for count in (1, 7):
            others = [
                prefill_rows(int(q), int(q) + int(c))
                for q, c in zip(
                    torch.randint(1, 20, (count,), generator=gen),
                    torch.randint(0, 20, (count,), generator=gen),
                )
            ]
            pos = int(torch.randint(0, count + 1, (1,), generator=gen))
            parts = [*others[:pos], needle, *others[pos:]]
            out = prefill(parts, causal)
            start = sum(p[0].shape[0] for p in parts[:pos])
            for a, b in zip(alone, out):
                _bits_equal(name, a, b[start : start + 9], f"{count} other requests, needle at {pos}")


def check_quant(
    table: OpTable, device: torch.device, dtype: torch.dtype, fmt: WeightFormat, case: str
) -> None:
    """The quantised-weight ops (issue 29) in ``fmt``: quant_fp8_group, fp8_linear and fp8_linear_w8a8
    (fp8 formats) per token; grouped_gemm_quant per (token, expert) row; fused_moe_quant per token;
    each deterministic formulation also against the reference."""
    from deepinfer.backends.testing.checks import quantized_weight, random_routing

    ops, gen, oracle = Deterministic(table), generator(case), reference_ops()
    shape = quant_moe("odd", fmt)
    e, d, inter = shape.experts, shape.hidden, shape.intermediate
    if fmt.kind == "fp8":
        k, n, group, ue8m0 = d, inter, fmt.block[1], fmt.scale_fmt == "ue8m0"
        x = randn(gen, 1, k)
        _rowwise(
            "quant_fp8_group", ops.quant_fp8_group, [x], lambda m: [randn(gen, m, k)], gen, device, dtype,
            (group, ue8m0),
        )  # fmt: skip
        values, scale = quantized_weight(gen, (), n, k, fmt)
        bias = randn(gen, n)
        w = (values.to(device), scale.to(device), fmt.block)
        got = _rowwise(
            "fp8_linear", ops.fp8_linear, [x], lambda m: [randn(gen, m, k)], gen, device, dtype,
            (*w, bias.to(device, dtype)),
        )  # fmt: skip
        want = oracle.fp8_linear(x.to(dtype).float(), values, scale, fmt.block, bias.to(dtype).float())
        assert_close(f"fp8_linear(deterministic)[{case}]", got, want, dtype)

        def quantized_rows(m: int) -> list[Tensor]:
            return list(oracle.quant_fp8_group(randn(gen, m, k), group, ue8m0))

        needle = quantized_rows(1)
        got = _rowwise(
            "fp8_linear_w8a8", ops.fp8_linear_w8a8, needle, quantized_rows, gen, device, None,
            (*w, bias.to(device, dtype), dtype),
        )  # fmt: skip
        want = oracle.fp8_linear_w8a8(
            *needle, values, scale, fmt.block, bias.to(dtype).float(), torch.float32
        )
        assert_close(f"fp8_linear_w8a8(deterministic)[{case}]", got, want, dtype)

    w13, w13_scale = (t.to(device) for t in quantized_weight(gen, (e,), 2 * inter, d, fmt))
    w2, w2_scale = (t.to(device) for t in quantized_weight(gen, (e,), d, inter, fmt))

    def routed(m: int) -> list[Tensor]:
        weights, ids = random_routing(gen, m, e, shape.top_k)
        return [randn(gen, m, d), weights, ids]

    needle = routed(1)
    got = _rowwise(
        "fused_moe_quant",
        lambda h, w, i: ops.fused_moe_quant(h, w13, w13_scale, w2, w2_scale, fmt, w, i),
        needle, routed, gen, device, dtype,
    )  # fmt: skip
    want = oracle.fused_moe_quant(
        needle[0].to(dtype).float(), w13.cpu(), w13_scale.cpu(), w2.cpu(), w2_scale.cpu(), fmt, *needle[1:]
    )
    assert_close(f"fused_moe_quant(deterministic)[{case}]", got, want, dtype)

    # grouped_gemm_quant: the needle row in expert g, mates spread over all experts (rows sorted by expert).
    g = int(torch.randint(0, e, (1,), generator=gen))
    x_needle = randn(gen, 1, d)
    alone_sizes = torch.zeros(e, dtype=torch.int64)
    alone_sizes[g] = 1
    alone = ops.grouped_gemm_quant(x_needle.to(device, dtype), w13, w13_scale, fmt, alone_sizes.to(device))
    for count in MATES:
        groups = torch.randint(0, e, (count,), generator=gen)
        rows = torch.cat((x_needle, randn(gen, count, d)))
        order = torch.argsort(torch.cat((torch.tensor([g]), groups)), stable=True)
        sizes = torch.bincount(torch.cat((torch.tensor([g]), groups)), minlength=e)
        out = ops.grouped_gemm_quant(rows[order].to(device, dtype), w13, w13_scale, fmt, sizes.to(device))
        pos = int((order == 0).nonzero())
        _bits_equal("grouped_gemm_quant", alone, out[pos : pos + 1], f"{count} mates, needle at {pos}")
    want = oracle.grouped_gemm_quant(x_needle.to(dtype).float(), w13.cpu(), w13_scale.cpu(), fmt, alone_sizes)
    assert_close(f"grouped_gemm_quant(deterministic)[{case}]", alone, want, dtype)
