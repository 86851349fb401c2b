"""Emulated ``npu_fused_infer_attention_score`` (v1) and ``_v2``: the forms deepinfer calls, validated as
their documentation (torch_npu 2.13.0 ``_op_plugin_docs.py``) states, computed in float32.

v2, TND without paging (prefill): Q_D = K_D = 128/192 with V_D = 128/192 per the doc's table, bfloat16
only, CUMULATIVE ``actual_seq_qlen`` / ``actual_seq_kvlen`` (mandatory; count = batch <= 4096; last = T),
sparse 0 (no mask), 3 or 4 (compressed mask). v2, TND + paged MLA (decode): query D 512 + query_rope 64,
one KV head, Q_N a power of two <= 128, 1..16 queries per request, CUMULATIVE ``actual_seq_qlen`` and
PER-REQUEST ``actual_seq_kvlen``, block size 16/128, sparse 0 without mask when every request has one query
else 3 with mask. v1, BSND + paged MLA with sparse 4 (windowed decode): N = 128, block size 64/128,
per-request lengths, key S <= 131088. Any other form raises NotImplementedError (not emulated).

Common rules: contiguous inputs; ``scale`` / ``softmax_scale`` default 1.0 (used as such); sparse 2/3/4
need the 2048 x 2048 lower-triangular compressed mask; sparse 3 needs q_len <= kv_len per request (the
doc writes "<"; pure prefill passes equal lengths, which vllm-ascend does too); masks are right-down
aligned, band limits pre/next counted from the right-down corner. Paged reads touch only the first
kv_len rows of each request's blocks. Rows of a padded BSND query beyond a request's query count are
returned as NaN (their content is unspecified).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from tests.ascend.emulation.runtime import host_call, npu_op

MASK_SIZE = 2048
NO_LIMIT = 2147483647
HALF = (torch.float16, torch.bfloat16)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"fused_infer_attention_score: {message}")


def _contiguous(**tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        _require(t is None or t.is_contiguous(), f"{name} must be contiguous")


def _check_mask(mask: Tensor | None, sparse_mode: int) -> None:
    if sparse_mode == 0:
        _require(mask is None, "a mask with sparse_mode 0 (full mask) is not emulated")
        return
    _require(sparse_mode in (3, 4), f"sparse_mode {sparse_mode} is not emulated")
    _require(mask is not None, f"sparse_mode {sparse_mode} needs the compressed atten_mask")
    _require(mask.dtype in (torch.bool, torch.int8, torch.uint8), f"atten_mask dtype {mask.dtype}")
    _require(
        tuple(mask.shape[-2:]) == (MASK_SIZE, MASK_SIZE) and mask.numel() == MASK_SIZE**2,
        f"atten_mask must be (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), got {tuple(mask.shape)}",
    )
    expected = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)
    _require(
        torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool().cpu(), expected),
        "atten_mask must be the lower-triangular compressed mask (1 above the diagonal)",
    )


def _cumulative(name: str, values: Sequence[int] | None, total: int) -> list[int]:
    _require(values is not None, f"{name} is mandatory in TND layout")
    values = list(values)
    _require(
        all(v >= 0 for v in values) and all(a <= b for a, b in itertools.pairwise(values)),
        f"{name} holds cumulative lengths: non-negative and non-decreasing, got {values}",
    )
    _require(
        bool(values) and values[-1] == total, f"{name} must end at the token count {total}, got {values}"
    )
    return [b - a for a, b in zip([0, *values], values)]


def _visible(q_len: int, kv_len: int, sparse_mode: int, pre_tokens: int, next_tokens: int) -> Tensor:
    """[q_len, kv_len] bool: query i (at key position kv_len - q_len + i) may attend key j."""
    pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    key = torch.arange(kv_len)[None, :]
    if sparse_mode == 0:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    if sparse_mode == 3:
        return key <= pos
    return (key >= pos - pre_tokens) & (key <= pos + next_tokens)


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """q [Sq, N, D], k [Sk, Nk, D], v [Sk, Nk, Dv] -> [Sq, N, Dv] float32 (fully masked rows give 0)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q.float(), k) * scale
    probs = scores.masked_fill(~visible[None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return torch.einsum("nqk,knd->qnd", probs, v)


def _check_sparse(sparse_mode: int, q_lens: list[int], kv_lens: list[int], pre: int, nxt: int) -> None:
    if sparse_mode == 3:
        _require(
            all(q <= k for q, k in zip(q_lens, kv_lens)), "sparse_mode 3 needs q_len <= kv_len per batch"
        )
    if sparse_mode == 4:
        _require(
            all(pre >= -q and nxt >= -k for q, k in zip(q_lens, kv_lens)) and pre + nxt >= 0,
            "band: pre_tokens >= -q_len, next_tokens >= -kv_len, pre_tokens + next_tokens >= 0",
        )


def _paged_rows(cache: Tensor, block_table: Tensor, batch: int, kv_len: int, block_size: int) -> Tensor:
    """The first kv_len rows of request ``batch``: [kv_len, D], reading only the blocks it needs."""
    blocks = block_table[batch, : -(-kv_len // block_size)].long()
    rows = cache.reshape(cache.shape[0], block_size, cache.shape[-1])[blocks]
    return rows.reshape(-1, cache.shape[-1])[:kv_len]


def _paged_layout(name: str, cache: Tensor, width: int, block_size: int, allow_bnnbsd: bool) -> None:
    shapes = [(block_size, width)] + ([(1, block_size, width)] if allow_bnnbsd else [])
    _require(
        tuple(cache.shape[1:]) in shapes,
        f"{name} must be [blocks, {block_size}, {width}]"
        + (" or [blocks, 1, block, D]" if allow_bnnbsd else "")
        + f", got {tuple(cache.shape)}",
    )


def _mla_paged(
    query: Tensor,
    query_rope: Tensor,
    key: Tensor,
    key_rope: Tensor,
    block_table: Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    block_size: int,
    scale: float,
    sparse_mode: int,
    pre: int,
    nxt: int,
) -> list[Tensor]:
    """Per request: attention of its [q_len, N, 512 + 64] queries over its paged latent + rope keys."""
    _require(
        block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2,
        "paged MLA needs block_table, int32 [B, max_blocks]",
    )
    _require(block_table.shape[0] == len(kv_lens), "block_table's first dimension must be the batch")
    _require(
        all(0 <= n <= block_table.shape[1] * block_size for n in kv_lens), "kv length beyond the block table"
    )
    outs, start = [], 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        latent = _paged_rows(key, block_table, b, kv_len, block_size)
        keys = torch.cat((latent, _paged_rows(key_rope, block_table, b, kv_len, block_size)), dim=-1)
        q = torch.cat((query[start : start + q_len], query_rope[start : start + q_len]), dim=-1)
        visible = _visible(q_len, kv_len, sparse_mode, pre, nxt)
        outs.append(_attend(q, keys[:, None], latent[:, None], visible, scale))
        start += q_len
    return outs


def fused_infer_attention_score_v2(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    query_rope: Tensor | None = None,
    key_rope: Tensor | None = None,
    atten_mask: Tensor | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    block_table: Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = NO_LIMIT,
    next_tokens: int = NO_LIMIT,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    inner_precise: int = 0,
    return_softmax_lse: bool = False,
    **unsupported: object,
) -> tuple[Tensor, Tensor]:
    _require(
        not any(v is not None for v in unsupported.values()), f"arguments not emulated: {sorted(unsupported)}"
    )
    _require(input_layout == "TND", f"only the TND layout is emulated, got {input_layout!r}")
    _require(not return_softmax_lse, "return_softmax_lse is not emulated")
    _require((query_rope is None) == (key_rope is None), "query_rope and key_rope come together")
    _contiguous(query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope)
    _require(
        query.dim() == 3 and query.shape[1] == num_query_heads,
        f"TND query is [T, N, D] with N = num_query_heads ({num_query_heads}), got {tuple(query.shape)}",
    )
    _require(
        query.dtype in HALF and key.dtype == query.dtype and value.dtype == query.dtype,
        "query, key and value are float16/bfloat16 of one dtype",
    )
    _check_mask(atten_mask, sparse_mode)
    lse = torch.zeros(1, dtype=torch.float32)
    if query.shape[-1] == 512:
        return _v2_mla(
            query,
            key,
            value,
            query_rope,
            key_rope,
            actual_seq_qlen,
            actual_seq_kvlen,
            block_table,
            num_key_value_heads,
            softmax_scale,
            sparse_mode,
            block_size,
        ), lse
    return _v2_tnd(
        query,
        key,
        value,
        query_rope,
        actual_seq_qlen,
        actual_seq_kvlen,
        block_table,
        num_key_value_heads,
        softmax_scale,
        sparse_mode,
        pre_tokens,
        next_tokens,
    ), lse


def _v2_mla(
    query,
    key,
    value,
    query_rope,
    key_rope,
    actual_seq_qlen,
    actual_seq_kvlen,
    block_table,
    num_key_value_heads,
    scale,
    sparse_mode,
    block_size,
) -> Tensor:
    heads = query.shape[1]
    _require(
        heads in (1, 2, 4, 8, 16, 32, 64, 128), f"MLA query heads must be a power of two <= 128, got {heads}"
    )
    _require(
        query_rope is not None and query_rope.shape == (*query.shape[:2], 64), "MLA query_rope is [T, N, 64]"
    )
    _require(key is value, "MLA: key and value are the same latent cache")
    _require(num_key_value_heads == 1, f"MLA has one KV head, got num_key_value_heads={num_key_value_heads}")
    _require(block_size in (16, 128), f"MLA block_size must be 16 or 128, got {block_size}")
    _paged_layout("key", key, 512, block_size, allow_bnnbsd=True)
    _paged_layout("key_rope", key_rope, 64, block_size, allow_bnnbsd=True)
    _require(key.shape[0] == key_rope.shape[0], "key and key_rope cover the same blocks")
    q_lens = _cumulative("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    _require(
        actual_seq_kvlen is not None and len(actual_seq_kvlen) == len(q_lens),
        "paged: actual_seq_kvlen holds one PER-REQUEST length per batch",
    )
    kv_lens = list(actual_seq_kvlen)
    _require(all(1 <= n <= 16 for n in q_lens), f"MLA: 1..16 query tokens per request, got {q_lens}")
    if max(q_lens) == 1:
        _require(sparse_mode == 0, "MLA with one query token per request takes sparse_mode 0 and no mask")
    else:
        _require(
            sparse_mode == 3, "MLA with several query tokens per request takes sparse_mode 3 and the mask"
        )
    _check_sparse(sparse_mode, q_lens, kv_lens, NO_LIMIT, NO_LIMIT)
    outs = _mla_paged(
        query,
        query_rope,
        key,
        key_rope,
        block_table,
        q_lens,
        kv_lens,
        block_size,
        scale,
        sparse_mode,
        NO_LIMIT,
        NO_LIMIT,
    )
    return torch.cat(outs).to(query.dtype)


TND_WIDTHS = {(128, 128, 128), (192, 192, 128), (192, 192, 192)}


def _v2_tnd(
    query,
    key,
    value,
    query_rope,
    actual_seq_qlen,
    actual_seq_kvlen,
    block_table,
    num_key_value_heads,
    scale,
    sparse_mode,
    pre,
    nxt,
) -> Tensor:
    _require(block_table is None, "TND with D != 512 does not support page attention")
    _require(query.dtype == torch.bfloat16, "TND (D != 512) supports bfloat16 only")
    widths = (query.shape[-1], key.shape[-1], value.shape[-1])
    if query_rope is None:
        _require(widths in TND_WIDTHS, f"TND Q_D/K_D/V_D must be one of {sorted(TND_WIDTHS)}, got {widths}")
    else:
        _require(widths == (128, 128, 128), "TND with rope inputs needs Q_D = K_D = V_D = 128")
        raise NotImplementedError("the TND split-rope form is not emulated")
    heads, kv_heads = query.shape[1], key.shape[1]
    _require(
        kv_heads == value.shape[1] and heads % kv_heads == 0 and heads // kv_heads <= 64,
        "K_N = V_N, Q_N divisible by K_N, ratio <= 64",
    )
    _require(
        num_key_value_heads in (0, kv_heads),
        f"num_key_value_heads {num_key_value_heads} != key heads {kv_heads}",
    )
    q_lens = _cumulative("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    kv_lens = _cumulative("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    _require(
        len(q_lens) == len(kv_lens) and len(q_lens) <= 4096, "one length per batch, at most 4096 batches"
    )
    _require(max(query.shape[0], key.shape[0]) <= 1 << 20, "T <= 1M")
    _check_sparse(sparse_mode, q_lens, kv_lens, pre, nxt)
    out = torch.empty(query.shape[0], heads, value.shape[-1], dtype=query.dtype)
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        visible = _visible(q_len, kv_len, sparse_mode, pre, nxt)
        out[q0 : q0 + q_len] = _attend(
            query[q0 : q0 + q_len], key[k0 : k0 + kv_len], value[k0 : k0 + kv_len], visible, scale
        ).to(query.dtype)
        q0, k0 = q0 + q_len, k0 + kv_len
    return out


def fused_infer_attention_score(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    query_rope: Tensor | None = None,
    key_rope: Tensor | None = None,
    atten_mask: Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    block_table: Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = NO_LIMIT,
    next_tokens: int = NO_LIMIT,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    softmax_lse_flag: bool = False,
    **unsupported: object,
) -> tuple[Tensor, Tensor]:
    _require(
        not any(v is not None for v in unsupported.values()), f"arguments not emulated: {sorted(unsupported)}"
    )
    if not (input_layout == "BSND" and query_rope is not None and sparse_mode == 4):
        raise NotImplementedError("FIA v1: only the BSND paged MLA band form (sparse_mode 4) is emulated")
    _require(not softmax_lse_flag, "softmax_lse_flag is not emulated")
    _contiguous(query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope)
    batch, seq, heads, width = query.shape
    _require(heads == 128 and num_heads == 128 and width == 512, "MLA band mode: N = 128, D = 512")
    _require(query_rope.shape == (batch, seq, heads, 64), "query_rope is [B, S, N, 64]")
    _require(key is value and num_key_value_heads == 1, "MLA: key is value (the latent cache), one KV head")
    _require(query.dtype in HALF and key.dtype == query.dtype, "float16/bfloat16 of one dtype")
    _require(block_size in (64, 128), f"MLA band mode: block_size 64 or 128, got {block_size}")
    _paged_layout("key", key, 512, block_size, allow_bnnbsd=False)
    _paged_layout("key_rope", key_rope, 64, block_size, allow_bnnbsd=False)
    _check_mask(atten_mask, sparse_mode)
    _require(
        actual_seq_lengths is not None and len(actual_seq_lengths) >= batch, "actual_seq_lengths per batch"
    )
    _require(
        actual_seq_lengths_kv is not None and len(actual_seq_lengths_kv) >= batch,
        "actual_seq_lengths_kv per batch",
    )
    q_lens, kv_lens = list(actual_seq_lengths[:batch]), list(actual_seq_lengths_kv[:batch])
    _require(all(0 <= q <= seq for q in q_lens), f"BSND actual_seq_lengths are per-batch counts <= S={seq}")
    _require(all(q <= k <= 131088 for q, k in zip(q_lens, kv_lens)), "band mode: q_len <= kv_len <= 131088")
    _check_sparse(sparse_mode, q_lens, kv_lens, pre_tokens, next_tokens)
    rows = query.reshape(batch * seq, heads, width)
    rope_rows = query_rope.reshape(batch * seq, heads, 64)
    index = torch.tensor([b * seq + i for b, n in enumerate(q_lens) for i in range(n)], dtype=torch.long)
    outs = _mla_paged(
        rows[index],
        rope_rows[index],
        key,
        key_rope,
        block_table,
        q_lens,
        kv_lens,
        block_size,
        scale,
        sparse_mode,
        pre_tokens,
        next_tokens,
    )
    out = torch.full((batch * seq, heads, width), float("nan"), dtype=query.dtype)
    out[index] = torch.cat(outs).to(query.dtype)
    return out.view(batch, seq, heads, width), torch.zeros(1, dtype=torch.float32)


def _v2_out(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    workspace: Tensor | None = None,
    out: list[Tensor],
    **kwargs: object,
) -> list[Tensor]:
    _require(
        isinstance(workspace, Tensor), "the .out overload under graph capture needs the workspace tensor"
    )
    attention, _ = fused_infer_attention_score_v2(query, key, value, **kwargs)
    _require(out[0].shape == attention.shape and out[0].dtype == attention.dtype, "attention_out shape/dtype")
    out[0].copy_(attention)
    return out


def _v2_max_workspace(query: Tensor, key: Tensor, value: Tensor, **kwargs: object) -> Tensor:
    fused_infer_attention_score_v2(query, key, value, **kwargs)  # validates the arguments
    return torch.empty(1024, dtype=query.dtype)


npu_fused_infer_attention_score = npu_op(fused_infer_attention_score)
npu_fused_infer_attention_score_v2 = npu_op(fused_infer_attention_score_v2)
npu_fused_infer_attention_score_v2.out = npu_op(_v2_out)
_npu_fused_infer_attention_score_v2_get_max_workspace = host_call(_v2_max_workspace)
