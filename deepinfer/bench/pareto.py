"""The per-user vs per-chip throughput trade-off: one offline run per concurrency level.

Per-user speed is each request's decode rate (tokens after the first, over the time from its first to
its last token), averaged over requests; per-chip throughput is all output tokens over the wall time.
Raising concurrency moves along the curve from fast-per-user to high-per-chip.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def measure(llm: LLM, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    engine = llm.engine
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_seqs=concurrency)
    engine.spec_stats = SpecDecodeStats()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    per_user = [
        (len(o.outputs[0].token_ids) - 1) / (o.metrics.finished_time - o.metrics.first_token_time)
        for o in outs
        if o.metrics.finished_time > o.metrics.first_token_time
    ]
    point = {
        "concurrency": concurrency,
        "per_user_tokens_per_s": statistics.fmean(per_user),
        "per_chip_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "mean_ttft_s": statistics.fmean(o.metrics.ttft for o in outs),
        "wall_s": wall,
    }
    if engine.num_draft_tokens:
        # The same run under full-acceptance accounting (every step credited with 1 + k tokens, as
        # DeepSeek's published charts do), to show the gap to what was really accepted.
        stats = engine.spec_stats
        inflation = (1 + engine.num_draft_tokens) / stats.mean_accepted_len
        point.update(
            mean_accepted_len=stats.mean_accepted_len,
            full_acceptance_per_user_tokens_per_s=point["per_user_tokens_per_s"] * inflation,
            full_acceptance_per_chip_tokens_per_s=point["per_chip_tokens_per_s"] * inflation,
        )
    return point


def sweep(llm: LLM, workload: Workload, levels: list[int]) -> dict:
    prompts = workload.prompts(llm.engine.tokenizer)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    points = [
        measure(llm, prompts[: max(c, min(len(prompts), 2 * c))], workload.output_len, c) for c in levels
    ]
    return {"points": points, "workload": workload.describe(), "env": environment(llm.engine)}


def plot(result: dict, path: Path) -> None:
    """Write the curve as a PNG (matplotlib is imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot([p["per_user_tokens_per_s"] for p in pts], [p["per_chip_tokens_per_s"] for p in pts], "o-",
            label="real acceptance")  # fmt: skip
    if "full_acceptance_per_user_tokens_per_s" in pts[0]:
        ax.plot([p["full_acceptance_per_user_tokens_per_s"] for p in pts],
                [p["full_acceptance_per_chip_tokens_per_s"] for p in pts], "s--",
                label="same run, full-acceptance accounting")  # fmt: skip
        ax.legend(fontsize=8)
    for p in pts:
        ax.annotate(
            str(p["concurrency"]), (p["per_user_tokens_per_s"], p["per_chip_tokens_per_s"]), fontsize=8
        )
    env = result["env"]
    ax.set_xlabel("per-user decode tokens/s")
    ax.set_ylabel("per-chip output tokens/s")
    ax.set_title(f"{env['model']} on {env['platform']} ({env['chip']})", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
