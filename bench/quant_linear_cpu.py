"""FP8 weights kept as stored against float32 weights, one projection at a time, on the fast CPU backend.

    .venv/bin/python bench/quant_linear_cpu.py [--reps 5] [--threads 2] [--quick] [--out FILE]

For each weight shape (the bundled model's projections, hidden 192, and DeepSeek-V3's at 7168) and
each row count (decode 1 and 4, prefill 512), times three ways of computing ``x @ W.T`` in float32:
``fp8``, the backend's ``fp8_linear`` on float8_e4m3fn weights with 128x128 float32 block scales (the
kernels of ``backends/cpu/csrc/quant_gemm.cpp``); ``fp32 kernel``, the backend's ``linear`` on float32
weights (its native few-row products up to 8 rows, oneDNN / MKL beyond); ``F.linear``, torch's own. The
three alternate within each rep (A B C A B C), each timed as the median over many calls; the report
gives every rep's median, the median over reps, the bytes each call reads (weights as stored, plus
activations and outputs) and the rate that makes, and fp32 kernel / fp8 (above 1: FP8 is faster).

The host is shared: the load average is recorded before and after, and the figures are indicative.
Writes ``bench/results/quant_linear_cpu.json`` with the git commit and whether the tree was clean.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_TUNABLES = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"

# (name, N, K): the bundled model (deepinfer-tiny-coder: hidden 192, q_lora 96, kv_lora 64 + rope 16,
# 4 heads, dense intermediate 512, experts 64, vocabulary 8192) and DeepSeek-V3 (hidden 7168).
SHAPES = [
    ("tiny q_a_proj", 96, 192),
    ("tiny kv_a_proj", 80, 192),
    ("tiny o_proj", 192, 128),
    ("tiny dense gate_up", 1024, 192),
    ("tiny dense down", 192, 512),
    ("tiny expert gate_up", 128, 192),
    ("tiny lm_head", 8192, 192),
    ("v3 q_a_proj", 1536, 7168),
    ("v3 expert gate_up", 4096, 7168),
    ("v3 expert down", 7168, 2048),
]
ROWS = [1, 4, 512]
BLOCK = (128, 128)


def _median_call_s(fn, budget_s: float) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = int(min(2000, max(5, budget_s / once)))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the bundled model's shapes only, 3 reps")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quant_linear_cpu.json")
    args = parser.parse_args()
    if os.environ.get("GLIBC_TUNABLES") != _TUNABLES:  # page-fault storms otherwise (FACTS.md)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": _TUNABLES})

    import torch
    import torch.nn.functional as F

    from deepinfer.backends.cpu import quant as cpu_quant
    from deepinfer.backends.cpu.backend import OPS
    from deepinfer.backends.quant import WeightFormat, quantize_weight

    OPS.finalize()
    torch.set_num_threads(args.threads)
    shapes = [s for s in SHAPES if s[0].startswith("tiny")] if args.quick else SHAPES
    reps = 3 if args.quick else args.reps
    fmt = WeightFormat("fp8", BLOCK)
    load_before = os.getloadavg()
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in shapes:
        weight = torch.randn(n, k, generator=gen) / k**0.5
        values, scale = quantize_weight(weight, fmt)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            budget = 0.15 if n * k * rows < 1e9 else 0.6
            sides = {
                "fp8": lambda x=x, v=values, s=scale: OPS.fp8_linear(x, v, s, BLOCK, None),
                "fp32 kernel": lambda x=x, w=weight: OPS.linear(x, w, None),
                "F.linear": lambda x=x, w=weight: F.linear(x, w),
            }
            per_rep: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(reps):
                for side, fn in sides.items():
                    per_rep[side].append(_median_call_s(fn, budget) * 1e6)
            activations = 4 * rows * (k + n)
            read = {
                "fp8": fmt.stored_bytes(n, k) + activations,
                "fp32 kernel": 4 * n * k + activations,
                "F.linear": 4 * n * k + activations,
            }
            entry = {"shape": name, "N": n, "K": k, "rows": rows, "sides": {}}
            for side, times in per_rep.items():
                median = statistics.median(times)
                entry["sides"][side] = {
                    "us_per_rep": [round(t, 2) for t in times],
                    "median_us": round(median, 2),
                    "bytes": read[side],
                    "GB_per_s": round(read[side] / median / 1e3, 2),
                }
            entry["fp32_kernel_over_fp8"] = round(
                entry["sides"]["fp32 kernel"]["median_us"] / entry["sides"]["fp8"]["median_us"], 3
            )
            results.append(entry)
            s = entry["sides"]
            print(
                f"{name:20s} {n:5d}x{k:<5d} rows {rows:4d}: fp8 {s['fp8']['median_us']:9.1f} us "
                f"({s['fp8']['GB_per_s']:6.1f} GB/s)  fp32 kernel {s['fp32 kernel']['median_us']:9.1f} us "
                f"({s['fp32 kernel']['GB_per_s']:6.1f} GB/s)  F.linear {s['F.linear']['median_us']:9.1f} us  "
                f"fp32/fp8 {entry['fp32_kernel_over_fp8']:.2f}",
                flush=True,
            )
    report = {
        "bench": "quant_linear_cpu",
        "commit": _git("rev-parse", "HEAD"),
        "tree_clean_for_the_kernels": _git(
            "status", "--porcelain", "--", "backends/cpu", "bench/quant_linear_cpu.py"
        )
        == "",
        "cpu": _cpu_name(),
        "isa": os.environ.get("DEEPINFER_CPU_ISA", "auto") + f" (supported: {cpu_quant.supported_isas()})",
        "threads": args.threads,
        "reps": reps,
        "block": list(BLOCK),
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "note": "shared 2-core host; medians of per-call medians, sides alternating within each rep; indicative",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
