"""Peer driver: llama.cpp through ``llama-cpp-python`` (its own venv), batched with one sequence per
request on one context, as research/peers.md measured it.

Setup: ``python3.11 -m venv venv-llama && CMAKE_BUILD_PARALLEL_LEVEL=2 venv-llama/bin/pip install
llama-cpp-python==0.3.36`` (builds from source, ~8 minutes), then convert the checkpoint with
``deepinfer/bench/peers/gguf_convert.py``; the job's ``model`` names the ``.gguf`` file. Greedy (argmax
in numpy), EOS ignored, prompts prefilled in batches of up to 2048 tokens, flash attention on auto,
non-unified KV (the library defaults that measured fastest). Standalone: does not import deepinfer.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(job_path: str, result_path: str) -> None:
    import llama_cpp as L

    job = json.loads(Path(job_path).read_text())
    prompts, new = job["prompts"], job["output_len"]
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["model"].encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    per_seq = max(len(p) for p in prompts) + new + 16
    params = L.llama_context_default_params()
    params.n_ctx = per_seq * len(prompts)
    params.n_batch = params.n_ubatch = 2048
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = job["threads"]
    params.kv_unified = False
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(2048, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        """entries: (token, position, sequence, want logits) -> sequence: logits of its last entry."""
        out: dict[int, np.ndarray] = {}
        for start in range(0, len(entries), 2048):
            chunk = entries[start : start + 2048]
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    ptr = L.llama_get_logits_ith(ctx, i)
                    out[seq] = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,)
                    ).copy()
        return out

    def generate(batch_prompts: list[list[int]]) -> list[list[int]]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        entries = [
            (t, pos, s, pos == len(p) - 1) for s, p in enumerate(batch_prompts) for pos, t in enumerate(p)
        ]
        last = decode(entries)
        outputs = [[int(last[s].argmax())] for s in range(len(batch_prompts))]
        for step in range(1, new):
            entries = [
                (out[-1], len(p) + step - 1, s, True)
                for s, (p, out) in enumerate(zip(batch_prompts, outputs))
            ]
            last = decode(entries)
            for s, out in enumerate(outputs):
                out.append(int(last[s].argmax()))
        return outputs

    warm = time.perf_counter()
    generate([p[:8] for p in prompts[:2]])
    warmup_s = time.perf_counter() - warm
    start = time.perf_counter()
    tokens = generate(prompts)
    wall = time.perf_counter() - start
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    result = {
        "wall_s": wall,
        "warmup_s": warmup_s,
        "output_tokens": sum(len(t) for t in tokens),
        "output_token_ids": tokens,
        "config": {"engine": "llama.cpp", "version": L.__version__, "threads": job["threads"], "kv_unified": False,
                   "flash_attn": "auto", "gguf": job["model"]},
    }  # fmt: skip
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
