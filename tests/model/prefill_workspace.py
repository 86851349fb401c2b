"""One MLA layer of a random DeepSeek-V3-shaped config running a prefill chunk over cached context,
through the real input builder and the active backend; run as a script it prints the chunk's peak
extra resident memory (for the workspace test, in a fresh process per measurement; run it with a fixed
glibc mmap threshold, so every large tensor is its own mapping and the resident size follows the live
tensors)."""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

from deepinfer.backends import ops
from deepinfer.engine.sched_output import ScheduledRequest
from deepinfer.model.attention import MLAAttention
from deepinfer.model.attn_metadata import CONTEXT_TILE_TOKENS
from deepinfer.model.config import ModelConfig
from deepinfer.model.rope import cos_sin_table
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.inputs import InputBuilder

# V3's attention structure (q LoRA, latent + decoupled rope, nope/rope/v head split) at reduced widths,
# so one process can hold a 16k-token context and expand it the old way in well under a second.
V3_SHAPED = dict(
    model_type="deepseek_v3", vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
    num_attention_heads=8, q_lora_rank=96, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, max_position_embeddings=32768,
)  # fmt: skip


class PrefillCase:
    """A layer with random weights and a paged cache holding random rows for every request's context."""

    def __init__(self, contexts: list[int], chunks: list[int], decodes: list[int], seed: int = 0) -> None:
        """``contexts`` / ``chunks``: cached tokens and new tokens of each prefill request; ``decodes``:
        cached tokens of each decode request (one new token each), scheduled first."""
        gen = torch.Generator().manual_seed(seed)
        self.config = ModelConfig(**V3_SHAPED)
        self.layer = MLAAttention(self.config, 0, torch.float32, "cpu")
        with torch.no_grad():
            for param in self.layer.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
                if param.dim() == 1:
                    param.fill_(1.0)
        self.layer.finish_loading()
        c = self.config
        spec = ops.kv_cache_spec(c.kv_lora_rank, c.qk_rope_head_dim, torch.float32)
        self.block_size = spec.block_size
        plan = [(n, 1) for n in decodes] + list(zip(contexts, chunks))
        blocks = [-(-(ctx + new) // spec.block_size) for ctx, new in plan]
        self.cache = spec.allocate(sum(blocks) + 1, "cpu")
        order = torch.randperm(sum(blocks), generator=gen).tolist()  # scattered blocks
        self.requests, cursor = [], 0
        for i, ((ctx, new), nb) in enumerate(zip(plan, blocks)):
            block_ids = order[cursor : cursor + nb]
            cursor += nb
            slots = torch.tensor([block_ids[p // spec.block_size] * spec.block_size + p % spec.block_size
                                  for p in range(ctx)], dtype=torch.int64)  # fmt: skip
            ops.kv_cache_write(
                torch.randn(ctx, c.kv_lora_rank, generator=gen),
                torch.randn(ctx, c.qk_rope_head_dim, generator=gen),
                self.cache,
                slots,
            )
            ids = torch.randint(0, c.vocab_size, (new,), generator=gen).tolist()
            self.requests.append(
                ScheduledRequest(
                    request_id=f"r{i}", token_ids=ids, num_computed_tokens=ctx, block_ids=block_ids,
                    samples=True, sampling_params=SamplingParams(temperature=0.0), seed=0,
                    num_prompt_tokens=ctx + new, prompt_token_ids=ids, output_token_ids=[],
                )
            )  # fmt: skip
        self.hidden = torch.randn(sum(new for _, new in plan), c.hidden_size, generator=gen)
        self.cos_sin = cos_sin_table(c)

    def forward(self, context_tile: int) -> torch.Tensor:
        """The layer's output [T, hidden] for the step, with context tiles of ``context_tile`` keys."""
        builder = InputBuilder(self.block_size, torch.device("cpu"), context_tile=context_tile)
        inputs = builder.prepare(self.requests)
        with torch.inference_mode():
            return self.layer(self.hidden, inputs.positions, inputs.meta, self.cache, self.cos_sin)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Return freed heap to the OS and restart the kernel's resident high-water mark (VmHWM) from the
    current resident size, which is returned (bytes)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """The resident high-water mark since ``reset_peak_rss`` (bytes)."""
    return _status_kib("VmHWM") * 1024


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, nargs="+", required=True, help="cached tokens, one run each")
    parser.add_argument("--context-tile", type=int, nargs="+", default=[CONTEXT_TILE_TOKENS],
                        help="keys per context tile, one per run (or one for all)")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=128, help="new tokens of the chunk")
    args = parser.parse_args(argv)
    tiles = args.context_tile * len(args.context) if len(args.context_tile) == 1 else args.context_tile
    torch.set_num_threads(1)
    PrefillCase([64], [args.chunk], []).forward(CONTEXT_TILE_TOKENS)  # warm-up: libraries, thread pools
    for context, tile in zip(args.context, tiles, strict=True):
        case = PrefillCase([context], [args.chunk], [])
        before = reset_peak_rss()
        case.forward(tile)
        peak = peak_rss() - before
        del case
        print(json.dumps({"context": context, "context_tile": tile, "peak_extra_bytes": peak}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
