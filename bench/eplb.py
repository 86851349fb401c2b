"""Live EPLB on the bundled model, 2 expert-parallel ranks: balance and throughput before and after.

    .venv/bin/python bench/eplb.py [--requests 32] [--output-len 48] [--reps 3] [--redundant 0] [--bias 0.5]

Workload: prompts cut from held-out standard-library code. The bundled model's own expert load on code
is only mildly skewed over 2 ranks (about 0.95 balance), so by default a routing bias is stated and
applied: ``--bias B`` is added to the router's correction bias (``e_score_correction_bias``) of the
experts of the first ``--hot-groups`` expert groups in every MoE layer, in a copy of the checkpoint,
which makes those experts hot (``--bias 0`` measures the unbiased model). Two data-parallel engines of 2 ranks each run side by side:
A keeps the initial placement (identity: rank 0 holds experts 0-7, i.e. groups 0 and 1, the hot ones), B
has live EPLB on; B serves the workload once as warm-up (it records the load and rearranges), then A and
B alternate (A B A B ...) on the same workload. Reported per engine (medians over reps): the balance,
mean over max of the per-rank expert pairs computed per step (the pairs each rank's experts received
through ep_dispatch, measured), and the output throughput; plus B's EPLB decisions (predicted balance
before/after, bytes moved). Results: bench/results/eplb.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.bench.report import git_commit
from deepinfer.bench.workload import Workload
from deepinfer.cli import reexec_with_malloc_tuning
from deepinfer.tokenizer import Tokenizer

RESULTS = Path(__file__).with_name("results") / "eplb.json"


def biased_copy(model: Path, dst: Path, bias: float, hot_groups: int) -> Path:
    """The checkpoint with ``bias`` added to the correction bias of the first ``hot_groups`` groups'
    experts of every MoE layer; other files are linked."""
    from safetensors.torch import load_file, save_file

    config = json.loads((model / "config.json").read_text())
    per_group = config["n_routed_experts"] // config["n_group"]
    dst.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.name != "model.safetensors" and not (dst / item.name).exists():
            (dst / item.name).symlink_to(item.resolve())
    tensors = load_file(model / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensor[: hot_groups * per_group] += bias
    save_file(tensors, dst / "model.safetensors")
    return dst


def balance_per_step(stats: list, start: list[int]) -> list[float]:
    """Mean/max over ranks of the expert pairs each rank computed, for each step since ``start``."""
    rows = zip(*(s.received[i:] for s, i in zip(stats, start)))
    return [statistics.fmean(r) / max(r) for r in rows if max(r) > 0]


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = [len(s.received) for s in llm.engine.collect_stats()]
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    stats = llm.engine.collect_stats()
    balance = balance_per_step(stats, before)
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / seconds,
        "steps": len(balance),
        "balance_mean": statistics.fmean(balance),
        "balance_median": statistics.median(balance),
        "balance_p10": sorted(balance)[len(balance) // 10],
        "token_ids": [o.token_ids for o in outputs],
    }


def summarise(runs: list[dict]) -> dict:
    keys = ("output_tok_per_s", "balance_mean", "balance_median", "balance_p10", "seconds")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"reps": len(runs)}


def main() -> None:
    reexec_with_malloc_tuning()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--redundant", type=int, default=0, help="redundant expert slots per layer")
    parser.add_argument("--interval", type=int, default=16, help="eplb_interval (computing steps)")
    parser.add_argument("--bias", type=float, default=0.5, help="routing bias added to the hot experts")
    parser.add_argument("--hot-groups", type=int, default=2, help="expert groups made hot by --bias")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("DEEPINFER_NUM_THREADS", "1")

    from deepinfer.model_zoo import default_model_path

    model = default_model_path()
    scratch = Path(tempfile.mkdtemp(prefix="eplb-bench-"))  # the biased copy; removed at the end
    try:
        if args.bias:
            model = biased_copy(model, scratch / model.name, args.bias, args.hot_groups)
        workload = Workload(args.requests, tuple(args.input_len), args.output_len, seed=0)
        prompts = workload.prompts(Tokenizer(model))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        common = dict(
            data_parallel_size=2,
            enable_expert_parallel=True,
            num_redundant_experts=args.redundant,
            num_kv_blocks=512,
        )
        a = LLM(str(model), **common)
        b = LLM(str(model), **common, eplb_interval=args.interval, eplb_window=100_000, eplb_min_gain=0.02)
        try:
            warmup = measure(b, prompts, params)
            runs: dict[str, list[dict]] = {"A_static": [], "B_eplb": []}
            for _ in range(args.reps):
                runs["A_static"].append(measure(a, prompts, params))
                runs["B_eplb"].append(measure(b, prompts, params))
            identical = all(r["token_ids"] == warmup["token_ids"] for rs in runs.values() for r in rs)
            decisions = b.engine.collect_stats()[0].decisions
        finally:
            a.close()
            b.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for rs in runs.values():
        for r in rs:
            r.pop("token_ids")
    warmup.pop("token_ids")
    result = {
        "benchmark": "eplb",
        "workload": workload.describe() | {"source": "held-out stdlib code (bench corpus)"},
        "engine": common | {"model": model.name, "eplb_interval": args.interval, "eplb_min_gain": 0.02},
        "routing_bias": {
            "bias": args.bias,
            "hot_groups": args.hot_groups,
            "what": "added to e_score_correction_bias of the experts of the first hot_groups groups, every MoE layer",
        },
        "before_static_placement": summarise(runs["A_static"]),
        "after_eplb": summarise(runs["B_eplb"]),
        "throughput_ratio_after_over_before": statistics.median(
            b_["output_tok_per_s"] / a_["output_tok_per_s"]
            for a_, b_ in zip(runs["A_static"], runs["B_eplb"])
        ),
        "outputs_identical_across_all_runs": identical,
        "eplb_warmup_run": warmup,
        "eplb_decisions": [
            dict(step=s, predicted_before=pb, predicted_after=pa, bytes_moved=m, applied=ap)
            for s, pb, pa, m, ap in decisions
        ],
        "runs": runs,
        "git_commit": git_commit(),
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    before, after = result["before_static_placement"], result["after_eplb"]
    print(
        f"balance (mean/max per-rank expert pairs per step): {before['balance_mean']:.3f} -> "
        f"{after['balance_mean']:.3f}; output tok/s {before['output_tok_per_s']:.1f} -> "
        f"{after['output_tok_per_s']:.1f} (ratio {result['throughput_ratio_after_over_before']:.3f}); "
        f"outputs identical: {identical}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
