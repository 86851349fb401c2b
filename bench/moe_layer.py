"""The MoE layer of the bundled model on the fast CPU backend, this tree against a baseline tree, A/B.

    .venv/bin/python bench/moe_layer.py [--baseline main] [--reps 5] [--threads 1 2] [--out FILE]
    .venv/bin/python bench/moe_layer.py --threshold [--threads 1 2]

Times one MoE layer's forward (``model.layers[1].mlp``: routing, routed experts, shared expert) and its
two routed-expert ops alone, on the bundled model's real weights, at 1, 8 and 64 decode tokens and a
2048-token prefill chunk. The hidden states are the layer's real inputs: a prompt from the bench
workload run through the model's layers before it, so routing spreads tokens over experts as it does in
use. Each rep runs the baseline tree (``git archive`` of ``--baseline`` into a temporary folder) and
then this tree, each in a fresh process with the same thread count and malloc settings (A B A B); a
process reports the median over many calls of each size, and the report gives every rep's figure, the
median over reps per side and the ratio of medians (baseline / new: above 1 means this tree is faster).

``--offline`` runs ``deepinfer bench offline`` instead, on both trees alternately (fresh processes, the
same threads and malloc settings): 1 request of 128 prompt tokens and 128 out, and the 64-request
default workload (prompts 64-1024, 128 out); output tokens per second per rep, medians and their ratio.

``--threshold`` sweeps rows per expert for ``fused_moe``'s two paths (the dot-product kernel against at::mm
on the gathered rows), to choose ``backends/cpu/moe.py``'s ``MM_ROWS``. About 4 minutes with the
defaults on a quiet 2-core host (``--offline``: about 10 minutes with --reps 3 --threads 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {"decode 1": 1, "decode 8": 8, "decode 64": 64, "prefill 2048": 2048}
OFFLINE = {
    "1 request, 128-token prompt, 128 out": ["--num-requests", "1", "--input-len-range", "128", "128"],
    "64 requests, prompts 64-1024, 128 out": [],  # bench offline's defaults
}


def _median_us(fn, tokens: int) -> float:
    calls = max(5, min(400, 40000 // tokens))
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _layer_inputs():
    """(the MoE module of layer 1, its real input hidden states [2048, D]) from the bundled model."""
    import torch

    from deepinfer import LLM
    from deepinfer.bench.workload import Workload

    llm = LLM(num_kv_blocks=512)
    model = llm.engine.runner.model
    ids = Workload(1, (2048, 2048), 1, seed=0).prompts(llm.engine.tokenizer)[0]
    layer = model.layers[1]
    chunks: list = []
    hook = layer.mlp.register_forward_pre_hook(lambda _m, args: chunks.append(args[0].detach().clone()))
    llm.generate(prompt_token_ids=[ids], sampling_params=_params())
    hook.remove()
    x = torch.cat(chunks)[:2048]  # the prompt's chunks, in order
    if x.shape[0] != 2048:
        raise RuntimeError(f"captured {x.shape[0]} rows of layer inputs, expected 2048")
    return layer.mlp, x.contiguous(), torch


def _params():
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def child(out: Path) -> None:
    """Measure this process's tree (whatever ``deepinfer`` imports from): one JSON of medians in us."""
    moe, x, torch = _layer_inputs()
    from deepinfer.backends import ops

    result = {}
    with torch.inference_mode():
        for name, tokens in SIZES.items():
            h = x[:tokens].contiguous()
            weights, ids = moe._route(h)
            result[name] = {
                "layer_us": _median_us(lambda h=h: moe(h), tokens),
                "route_us": _median_us(lambda h=h: moe._route(h), tokens),
                "fused_moe_us": _median_us(
                    lambda h=h, w=weights, i=ids: ops.fused_moe(h, moe.experts.w13, moe.experts.w2, w, i),
                    tokens,
                ),
            }
    out.write_text(json.dumps(result))


def threshold_child(out: Path) -> None:
    """fused_moe with every expert on one path, at 1-128 rows per expert (the bundled model's expert shapes,
    float32 and bfloat16)."""
    import torch

    from deepinfer.backends.cpu import backend  # noqa: F401  (activates the fast kernels)

    native = torch.ops.deepinfer_cpu
    gen = torch.Generator().manual_seed(0)
    experts, dim, inter, top_k = 16, 192, 64, 4
    w13 = torch.randn(experts, 2 * inter, dim, generator=gen) * dim**-0.5
    w2 = torch.randn(experts, dim, inter, generator=gen) * inter**-0.5
    result: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = w13.to(dtype), w2.to(dtype)
        for rows in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128):
            tokens = rows * experts // top_k  # every expert gets `rows` rows
            ids = (torch.arange(tokens * top_k) % experts).view(tokens, top_k).to(torch.int32)
            weights = torch.rand(tokens, top_k, generator=gen)
            h = torch.randn(tokens, dim, generator=gen).to(dtype)
            result[f"{dtype} {rows}"] = {
                path: _median_us(partial(native.fused_moe, h, a, b, weights, ids, mm), tokens)
                for path, mm in (("kernel", 1 << 30), ("mm", 1))
            }
    out.write_text(json.dumps(result))


def _env(tree: Path, threads: int) -> dict[str, str]:
    from deepinfer.malloc_tuning import MALLOC_TUNABLES

    return {
        **os.environ,
        "DEEPINFER_CPU_BACKEND": "fast",
        "DEEPINFER_ACCELERATOR": "cpu",
        "GLIBC_TUNABLES": MALLOC_TUNABLES,
        "OMP_NUM_THREADS": str(threads),
        "DEEPINFER_NUM_THREADS": str(threads),
        "PYTHONPATH": str(tree),
    }


def _run(tree: Path, threads: int, mode: str, tmp: Path) -> dict:
    out = tmp / "result.json"
    env = _env(tree, threads)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), f"--{mode}", str(out)],
        env=env, cwd=tree, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} in {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _baseline_tree(rev: str, dest: Path) -> Path:
    archive = dest / "baseline.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), rev], check=True)
    tree = dest / "baseline"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def compare(args: argparse.Namespace) -> dict:
    report: dict = {"baseline": args.baseline, "reps": args.reps, "by_threads": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        baseline = _baseline_tree(args.baseline, tmp)
        for threads in args.threads:
            reps: dict[str, list[dict]] = {"baseline": [], "new": []}
            for rep in range(args.reps):
                for side, tree in (("baseline", baseline), ("new", REPO)):
                    reps[side].append({"load": os.getloadavg()[0], **_run(tree, threads, "child", tmp)})
                    print(f"threads {threads} rep {rep} {side}: {json.dumps(reps[side][-1])}", flush=True)
            summary = {}
            for size in SIZES:
                summary[size] = {}
                for metric in ("layer_us", "route_us", "fused_moe_us"):
                    med = {s: statistics.median(r[size][metric] for r in reps[s]) for s in reps}
                    summary[size][metric] = {**med, "baseline/new": med["baseline"] / med["new"]}
            report["by_threads"][str(threads)] = {"reps": reps, "median": summary}
    return report


def offline(args: argparse.Namespace) -> dict:
    report: dict = {"baseline": args.baseline, "reps": args.reps, "by_threads": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        baseline = _baseline_tree(args.baseline, Path(tmp_name))
        for threads in args.threads:
            block: dict = {}
            for workload, extra in OFFLINE.items():
                reps: dict[str, list[dict]] = {"baseline": [], "new": []}
                for _rep in range(args.reps):
                    for side, tree in (("baseline", baseline), ("new", REPO)):
                        load = os.getloadavg()[0]
                        cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "offline", "--threads", str(threads),
                               "--output-len", "128", "--json", *extra]  # fmt: skip
                        proc = subprocess.run(
                            cmd,
                            env=_env(tree, threads),
                            cwd=tree,
                            capture_output=True,
                            text=True,
                            timeout=1800,
                        )
                        if proc.returncode != 0:
                            raise RuntimeError(f"bench offline in {tree} failed:\n{proc.stderr[-3000:]}")
                        result = json.loads(proc.stdout)
                        reps[side].append(
                            {"load": load, "output_tokens_per_s": result["output_tokens_per_s"]}
                        )
                        print(f"threads {threads} {workload} {side}: {reps[side][-1]}", flush=True)
                med = {s: statistics.median(r["output_tokens_per_s"] for r in reps[s]) for s in reps}
                block[workload] = {
                    "reps": reps,
                    "median_tok_s": med,
                    "new/baseline": med["new"] / med["baseline"],
                }
            report["by_threads"][str(threads)] = block
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="main", help="git revision of the tree to compare against")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threshold", action="store_true", help="sweep fused_moe's two paths instead")
    parser.add_argument("--offline", action="store_true", help="end to end: deepinfer bench offline, A/B")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threshold-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if args.threshold_child:
        return threshold_child(args.threshold_child)
    if args.threshold:
        with tempfile.TemporaryDirectory() as tmp:
            report = {str(t): _run(REPO, t, "threshold-child", Path(tmp)) for t in args.threads}
    elif args.offline:
        report = offline(args)
    else:
        report = compare(args)
    text = json.dumps(report, indent=1)
    print(text if args.out is None else f"written to {args.out}")
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.offline:
        for threads, block in report["by_threads"].items():
            for workload, r in block.items():
                med = r["median_tok_s"]
                print(f"threads {threads} {workload}: {med['baseline']:.1f} -> {med['new']:.1f} tok/s "
                      f"({r['new/baseline']:.2f}x)")  # fmt: skip
    elif not args.threshold:
        for threads, block in report["by_threads"].items():
            for size, metrics in block["median"].items():
                cells = "  ".join(
                    f"{m[:-3]} {v['baseline']:.0f}->{v['new']:.0f}us ({v['baseline/new']:.2f}x)"
                    for m, v in metrics.items()
                )
                print(f"threads {threads} {size:>13}: {cells}")


if __name__ == "__main__":
    main()
