"""Quality of a model on held-out code, through the engine: perplexity vs. a unigram baseline on the
same tokens, and the share of greedy completions of held-out function signatures that parse.

    .venv/bin/python bench/quality.py [--model PATH] [--signatures 50] [--windows 32]
    .venv/bin/python bench/quality.py --model deepinfer-tiny-coder-fp8 --reference deepinfer-tiny-coder \
        --out bench/results/quality_fp8.json

With ``--reference``: the model against a reference on the same held-out tokens, each through the
engine in turn (one process, fresh ``LLM`` each): perplexity and next-token top-1 accuracy of both,
their ratio, how often their top-1 predictions agree, and the mean |difference| of the actual token's
log-probability (the FP8 copy of the bundled model against its float32 source, issue 29).

Held-out files are those the tiny model's training split excluded (deepinfer.bench.corpus). A
completion counts when the signature line plus the completion's first complete lines, up to the
first line that dedents to the signature's level, parse with ``ast`` as a function. Greedy decoding,
plain and with a repetition penalty (a 5.7M-parameter model falls into loops when greedy).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.bench import quality
from deepinfer.bench.report import environment
from deepinfer.malloc_tuning import reexec_with_malloc_tuning
from deepinfer.model_zoo import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--signatures", type=int, default=50)
    parser.add_argument("--windows", type=int, default=32, help="held-out windows for perplexity")
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--repetition-penalty", type=float, nargs="+", default=[1.0, 1.2],
        help="the parse share is measured at each (1.0 = plain greedy)",
    )  # fmt: skip
    parser.add_argument("--out", default="bench/results/quality.json")
    parser.add_argument("--reference", help="compare --model with this model on the same tokens (see above)")
    args = parser.parse_args()
    reexec_with_malloc_tuning()
    if args.reference:
        compare(args)
        return

    llm = LLM(args.model)
    windows = quality.heldout_slice(llm, args.windows, args.window_len)
    model_ppl = quality.perplexity(llm, windows)
    unigram_ppl = quality.unigram_perplexity(windows, llm.engine.model_config.vocab_size)
    signatures = quality.heldout_signatures(args.signatures)
    by_penalty = {}
    for penalty in args.repetition_penalty:
        completions = quality.signature_completions(llm, signatures, args.max_tokens, penalty)
        parsed = sum(ok for _, _, ok in completions)
        by_penalty[str(penalty)] = {
            "parsing_completions": parsed,
            "parse_share": parsed / len(signatures),
            "completions": [{"signature": s, "completion": c, "parses": ok} for s, c, ok in completions],
        }
    result = {
        "perplexity": model_ppl,
        "unigram_perplexity": unigram_ppl,
        "perplexity_ratio": model_ppl / unigram_ppl,
        "heldout_tokens": sum(len(w) - 1 for w in windows),
        "signatures": len(signatures),
        "by_repetition_penalty": by_penalty,
        "env": environment(llm.engine),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    shares = {p: r["parse_share"] for p, r in by_penalty.items()}
    print(
        json.dumps(
            {"perplexity": model_ppl, "unigram_perplexity": unigram_ppl, "parse_share": shares}, indent=2
        )
    )


def token_scores(llm: LLM, windows: list[list[int]]) -> list[tuple[float, int]]:
    """For every token after the first of each window: (log p of the actual token, the top-1 token)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate(prompt_token_ids=windows, sampling_params=params)
    scores = []
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            scores.append((entry[token].logprob, top))
    return scores


def weights_held(llm: LLM) -> dict:
    """How the engine held the model's weights: stored bytes by dtype (parameters and buffers)."""
    from deepinfer.worker.memory_profile import weight_memory

    memory = weight_memory(llm.engine.model)
    return {"summary": llm.engine.weights_summary, "total_bytes": memory.total_bytes,
            "quantised_bytes": memory.quantised_bytes, "by_dtype": memory.by_dtype}  # fmt: skip


def cpu_model() -> str:
    """``lscpu``'s "Model name" (the host's CPU: ratios move with it, FACTS.md)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, check=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    raise RuntimeError("lscpu printed no 'Model name:' line")


def compare(args: argparse.Namespace) -> None:
    """``--reference``: both models on the same held-out windows; writes ``--out``."""
    sides, windows, env = {}, None, None
    for role, model in (("reference", args.reference), ("model", args.model)):
        llm = LLM(str(resolve_model(model)))
        if windows is None:
            windows = quality.heldout_slice(llm, args.windows, args.window_len)
        scores = token_scores(llm, windows)
        targets = [t for w in windows for t in w[1:]]
        sides[role] = {
            "model": str(llm.engine.checkpoint.path),
            "perplexity": math.exp(-statistics.fmean(lp for lp, _ in scores)),
            "top1_accuracy": statistics.fmean(top == t for (_, top), t in zip(scores, targets)),
            "weights": weights_held(llm),
            "scores": scores,
        }
        env, op_backend = environment(llm.engine), llm.engine.platform.op_backend
        llm.close()
    ref, ours = sides["reference"].pop("scores"), sides["model"].pop("scores")
    result = {
        "model": sides["model"],
        "reference": sides["reference"],
        "perplexity_ratio": sides["model"]["perplexity"] / sides["reference"]["perplexity"],
        "top1_agreement": statistics.fmean(a[1] == b[1] for a, b in zip(ours, ref)),
        "mean_abs_logprob_diff": statistics.fmean(abs(a[0] - b[0]) for a, b in zip(ours, ref)),
        "heldout_tokens": len(ours),
        "windows": args.windows,
        "window_len": args.window_len,
        "env": {**env, "cpu": cpu_model(), "op_backend": op_backend},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=2, default=str))


if __name__ == "__main__":
    main()
