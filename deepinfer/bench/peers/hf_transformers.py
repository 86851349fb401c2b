"""Peer driver: Hugging Face transformers ``generate`` on the CPU, its best batched configuration.

All prompts in one left-padded batch, greedy, EOS ignored (exactly ``output_len`` new tokens each),
default attention (sdpa) and grouped-GEMM experts, float32. Standalone: does not import deepinfer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(job_path: str, result_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    prompts, new = job["prompts"], job["output_len"]
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        warm = time.perf_counter()
        model.generate(
            ids[:2, -8:], attention_mask=mask[:2, -8:], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        warmup_s = time.perf_counter() - warm
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        wall = time.perf_counter() - start
    tokens = out[:, width:].tolist()
    result = {
        "wall_s": wall,
        "warmup_s": warmup_s,
        "output_tokens": sum(len(t) for t in tokens),
        "output_token_ids": tokens,
        "config": {"engine": "transformers", "version": __import__("transformers").__version__, "batch": len(prompts),
                   "attn": "sdpa", "dtype": "float32", "threads": job["threads"]},
    }  # fmt: skip
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
