"""Multi-head latent attention (MLA): expanded form for prefill, absorbed form for decode.

Per token the cache holds only the normalised latent ``c`` (kv_lora_rank wide) and the rotated rope key
(qk_rope_head_dim wide). Prefill expands cached and new latents into per-head keys and values with
``kv_b_proj`` and runs ``mla_prefill`` (over a cached context longer than ``CONTEXT_TILE_TOKENS``,
tile by tile with ``mla_prefill_partial`` and a log-sum-exp merge, so the expanded keys held at once
stay bounded); decode folds ``W_UK`` into the query and ``W_UV`` after the
attention, so ``mla_decode`` reads the latent cache directly (MQA with one 576-wide head for V3).

With a quantised checkpoint the projections stay FP8 where the ``WeightPlan`` says so, except
``kv_b_proj``: it is dequantised once at load into the model dtype, since the absorbed decode path
reads it as per-head factors (``w_uk``, ``w_uv``), as DeepSeek's reference does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from deepinfer.backends import ops
from deepinfer.model.attn_metadata import AttentionMetadata, PrefillMetadata
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import Linear, RMSNorm, linear
from deepinfer.model.weight_plan import WeightPlan


class MLAAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str,
        plan: WeightPlan | None = None,
    ) -> None:
        super().__init__()
        c = config
        prefix = f"model.layers.{layer}.self_attn."

        def quant(name: str):
            return None if plan is None else plan.linear(f"{prefix}{name}.weight")

        self.heads = c.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.latent = c.kv_lora_rank
        self.scale = c.softmax_scale
        self.window = c.window_of(layer)
        self.interleaved = c.rope_interleave
        bias = c.attention_bias
        self.q_lora = bool(c.q_lora_rank)
        if self.q_lora:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, bias, dtype, device, quant("q_a_proj"))
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype, device)
            self.q_b_proj = linear(
                c.q_lora_rank, self.heads * c.qk_head_dim, False, dtype, device, quant("q_b_proj")
            )
        else:
            self.q_proj = linear(
                c.hidden_size, self.heads * c.qk_head_dim, False, dtype, device, quant("q_proj")
            )
        self.kv_a_proj_with_mqa = linear(
            c.hidden_size, self.latent + self.rope_dim, bias, dtype, device, quant("kv_a_proj_with_mqa")
        )
        self.kv_a_layernorm = RMSNorm(self.latent, c.rms_norm_eps, dtype, device)
        self.kv_b_proj = Linear(self.latent, self.heads * (self.nope + self.v_dim), False, dtype, device)
        if plan is not None and plan.dense is not None and f"{prefix}kv_b_proj.weight" in plan.quantised:
            plan.note(
                f"kv_b_proj dequantised to {str(dtype).removeprefix('torch.')} at load (absorbed MLA decode)"
            )
        self.o_proj = linear(self.heads * self.v_dim, c.hidden_size, bias, dtype, device, quant("o_proj"))
        self.w_uk: Tensor | None = None  # [H, L, Dn] (per-head linear layout), set by finish_loading
        self.w_uv: Tensor | None = None  # [H, Dv, L]

    def finish_loading(self) -> None:
        """Split kv_b_proj into the absorbed-decode factors (views, no copy)."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.latent)
        self.w_uk, self.w_uv = w[:, : self.nope].transpose(1, 2), w[:, self.nope :]

    def forward(
        self,
        hidden: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_cache: Sequence[Tensor],
        cos_sin: Tensor,
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(num_tokens, self.heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split((self.nope, self.rope_dim), dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split((self.latent, self.rope_dim), dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = ops.rope(q_pe, k_pe, positions, cos_sin, self.interleaved)
        keep_cached = self.window is None and meta.full_slot_mapping is not None
        ops.kv_cache_write(kv_c, k_pe, kv_cache, meta.full_slot_mapping if keep_cached else meta.slot_mapping)

        num_decode = meta.num_decode_tokens
        parts = []  # [T_part, H, Dv]: the decode tokens' attention output, then the prefill tokens'
        if meta.decode is not None:
            d = meta.decode
            q_latent = ops.linear(q_nope[:num_decode], self.w_uk, None)
            o_latent = ops.mla_decode(
                q_latent,
                q_pe[:num_decode].contiguous(),
                kv_cache,
                d.block_table,
                d.seq_lens,
                d.query_start_loc,
                d.max_query_len,
                self.scale,
                self.window,
            )
            parts.append(ops.linear(o_latent, self.w_uv, None))
        if meta.prefill is not None:
            p = meta.prefill
            q_prefill = torch.cat((q_nope[num_decode:], q_pe[num_decode:]), dim=-1)
            if p.context_tiles and self.window is None:
                parts.append(self._tiled_prefill(q_prefill, p, meta.slot_mapping[num_decode:], kv_cache))
            else:
                if p.context_slots is None:
                    ctx_c, ctx_pe = kv_c[num_decode:], k_pe[num_decode:]
                else:
                    ctx_c, ctx_pe = ops.kv_cache_gather(kv_cache, p.context_slots, self.latent)
                k, v = self._expand(ctx_c, ctx_pe, hidden.dtype)
                parts.append(
                    ops.mla_prefill(
                        q_prefill,
                        k,
                        v,
                        p.cu_seqlens_q,
                        p.cu_seqlens_k,
                        p.max_seqlen_q,
                        p.max_seqlen_k,
                        self.scale,
                        self.window,
                    )
                )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(num_tokens, self.heads * self.v_dim))

    def _expand(self, latent: Tensor, k_pe: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Cached rows [N, L] and [N, R] -> per-head keys [N, H, Dn + R] and values [N, H, Dv]."""
        num_keys = latent.shape[0]
        kv = self.kv_b_proj(latent.to(dtype)).view(num_keys, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_pe.to(dtype)[:, None, :].expand(-1, self.heads, -1)), dim=-1)
        return k, v.contiguous()

    def _tiled_prefill(
        self, q: Tensor, p: PrefillMetadata, new_slots: Tensor, kv_cache: Sequence[Tensor]
    ) -> Tensor:
        """Prefill attention over a long cached context in bounded workspace: the step's own keys
        causally, then each context tile (at most CONTEXT_TILE_TOKENS keys expanded at once), merged by
        log-sum-exp in float32. q: [Tp, H, Dn + R] -> [Tp, H, Dv] in q's dtype."""
        k, v = self._expand(*ops.kv_cache_gather(kv_cache, new_slots, self.latent), q.dtype)
        acc, acc_lse = ops.mla_prefill_partial(
            q, k, v, p.cu_seqlens_q, p.cu_seqlens_q, p.max_seqlen_q, p.max_seqlen_q, self.scale, True
        )
        del k, v
        for tile in p.context_tiles:
            k, v = self._expand(*ops.kv_cache_gather(kv_cache, tile.slots, self.latent), q.dtype)
            rows = slice(tile.q_start, tile.q_end)
            part, part_lse = ops.mla_prefill_partial(
                q[rows], k, v, tile.cu_seqlens_q, tile.cu_seqlens_k, tile.max_seqlen_q,
                tile.max_seqlen_k, self.scale, False,
            )  # fmt: skip
            del k, v
            merge_attention(acc[rows], acc_lse[rows], part, part_lse)
        return acc.to(q.dtype)


def merge_attention(acc: Tensor, acc_lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Fold one piece of attention into a running result, in place: acc [T, H, Dv] and acc_lse [T, H]
    (float32, acc_lse finite) become the attention over both pieces' keys; part_lse may be -inf (no
    keys in the piece)."""
    lse = torch.logaddexp(acc_lse, part_lse)
    acc.mul_(torch.exp(acc_lse - lse)[..., None]).add_(part * torch.exp(part_lse - lse)[..., None])
    acc_lse.copy_(lse)
