"""GPU benchmark of the NVIDIA backend (deepinfer.ops_cuda) at DeepSeek-V3 shapes.

On one GPU it measures two ceilings, the device copy bandwidth (a large tensor copy, bytes read plus
written) and the dense bf16 matmul rate; runs the conformance suite (bfloat16); then times every op at
DeepSeek-V3 decode and prefill shapes and reports the bandwidth or FLOP rate it achieves as a fraction
of the measured ceiling, as a table and as JSON. About four minutes on an H200, well under six.

    python bench/device_nvidia.py [--out bench/results/device_nvidia.json] [--skip-conformance]

Targets reported: mla_decode >= 60% of copy bandwidth (batch 64, context 4096, 128 heads, 512 + 64);
fused_moe >= 40% of the dense bf16 matmul rate (4096 tokens, 256 experts, top-8, 7168 / 2048);
sampling < 5% of a decode step, the step being bounded below by 61 layers of mla_decode at that batch.
Timing: torch.cuda.Event around each call, after warm-up, median of the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "device_nvidia.json"
NO_GPU_EXIT = 2

# DeepSeek-V3.
LAYERS = 61
HEADS, LATENT, ROPE, NOPE, V_HEAD = 128, 512, 64, 128, 128
HIDDEN, EXPERT_INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP = 7168, 2048, 256, 8, 8, 4
VOCAB = 129280
BF16 = 2

MLA_DECODE_TARGET = 0.60  # of copy bandwidth
FUSED_MOE_TARGET = 0.40  # of dense bf16 matmul rate
SAMPLING_TARGET = 0.05  # of a decode step


# ------------------------------------------------------------------------------------- roofline


@dataclass(frozen=True, slots=True)
class Cost:
    """What one call moves and computes; ``bound`` says which ceiling it is judged against."""

    bytes: float
    flops: float
    bound: str  # "memory" or "compute"


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


def mla_decode_cost(batch: int, context: int, queries_per_req: int = 1, elem: int = BF16) -> Cost:
    """Absorbed MLA decode: every request's context is read once (L + R wide rows); each of its query
    rows scores every key (L + R) and sums values (L)."""
    width = LATENT + ROPE
    rows = batch * queries_per_req * HEADS
    kv = batch * context * width * elem
    io = rows * (width + LATENT) * elem
    return Cost(kv + io, 2.0 * rows * context * (width + LATENT), "memory")


def mla_prefill_cost(prompt: int, elem: int = BF16) -> Cost:
    """Causal attention of one prompt with itself: prompt * (prompt + 1) / 2 visible (query, key) pairs."""
    qk = NOPE + ROPE
    pairs = prompt * (prompt + 1) / 2
    io = prompt * HEADS * (2 * qk + 2 * V_HEAD) * elem
    return Cost(io, 2.0 * HEADS * pairs * (qk + V_HEAD), "compute")


def fused_moe_cost(tokens: int, experts_touched: int, elem: int = BF16) -> Cost:
    """Gate/up GEMM (2I x D), SwiGLU, down GEMM (D x I) for tokens * top_k pairs; each touched expert's
    weights are read once."""
    pairs = tokens * TOP_K
    weights = experts_touched * 3 * HIDDEN * EXPERT_INTER * elem
    io = (tokens * 2 * HIDDEN + pairs * (EXPERT_INTER + HIDDEN) * 2) * elem
    bound = "compute" if tokens * TOP_K >= experts_touched * 128 else "memory"
    return Cost(weights + io, 6.0 * pairs * HIDDEN * EXPERT_INTER, bound)


def streaming_cost(bytes_moved: float) -> Cost:
    """An elementwise or row-wise op: judged by the bytes it reads and writes."""
    return Cost(bytes_moved, 0.0, "memory")


def fraction_of_ceiling(cost: Cost, seconds: float, ceilings: Ceilings) -> float:
    """Achieved rate over the matching ceiling (bandwidth for memory-bound ops, FLOP rate otherwise)."""
    if cost.bound == "memory":
        return cost.bytes / seconds / ceilings.copy_bytes_per_s
    return cost.flops / seconds / ceilings.matmul_flops_per_s


@dataclass(slots=True)
class OpResult:
    name: str
    shape: str
    ms: float
    cost: Cost
    fraction: float
    gb_per_s: float = field(init=False)
    tflop_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.gb_per_s = self.cost.bytes / (self.ms * 1e-3) / 1e9
        self.tflop_per_s = self.cost.flops / (self.ms * 1e-3) / 1e12


def measure(name: str, shape: str, ms: float, cost: Cost, ceilings: Ceilings) -> OpResult:
    return OpResult(name, shape, ms, cost, fraction_of_ceiling(cost, ms * 1e-3, ceilings))


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float
    limit: float
    at_least: bool  # value >= limit passes (else value < limit passes)

    @property
    def met(self) -> bool:
        return self.value >= self.limit if self.at_least else self.value < self.limit


def targets(results: dict[str, OpResult], ceilings: Ceilings) -> list[Target]:
    """The three targets, from the measured op results (keys: mla_decode, fused_moe, sample)."""
    decode, moe = results["mla_decode"], results["fused_moe"]
    step_ms = LAYERS * decode.ms  # attention alone: a lower bound of a decode step at this batch
    return [
        Target("mla_decode fraction of copy bandwidth", decode.gb_per_s * 1e9 / ceilings.copy_bytes_per_s,
               MLA_DECODE_TARGET, at_least=True),
        Target("fused_moe fraction of bf16 matmul rate", moe.tflop_per_s * 1e12 / ceilings.matmul_flops_per_s,
               FUSED_MOE_TARGET, at_least=True),
        Target("sample fraction of a decode step", results["sample"].ms / step_ms, SAMPLING_TARGET, at_least=False),
    ]  # fmt: skip


def format_table(results: list[OpResult], goals: list[Target]) -> str:
    head = f"{'op':<22} {'shape':<44} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'bound':>7} {'of ceiling':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<22} {r.shape:<44} {r.ms:>9.4f} {r.gb_per_s:>8.0f} {r.tflop_per_s:>8.1f} "
            f"{r.cost.bound:>7} {r.fraction:>9.1%}"
        )
    lines.append("")
    for g in goals:
        relation = ">=" if g.at_least else "<"
        lines.append(
            f"{'PASS' if g.met else 'MISS'}  {g.name}: {g.value:.1%} (target {relation} {g.limit:.0%})"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- GPU side


def median_ms(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median time of ``fn`` in milliseconds, each repetition timed by its own pair of CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_ms(reps: int) -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()  # 2 GiB
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), 3, reps)


def _matmul_ms(n: int, reps: int) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return median_ms(lambda: torch.matmul(a, b), 3, reps)


def measure_ceilings(reps: int) -> Ceilings:
    """Copy bandwidth (2 GiB bf16 tensor copied: bytes read + written) and bf16 matmul rate (8192^3)."""
    n = 8192
    copy_bytes = 2 * (1 << 30) * BF16
    return Ceilings(copy_bytes / (_copy_ms(reps) * 1e-3), 2.0 * n**3 / (_matmul_ms(n, reps) * 1e-3))


def run_conformance(full: bool, timeout_s: int) -> dict[str, Any]:
    """The conformance suite on this GPU in bfloat16 (V3 attention shapes; MoE at V3 sizes with --full)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "conformance.xml"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "DEEPINFER_ACCELERATOR": "nvidia",
            "DEEPINFER_CONFORMANCE_DTYPES": "bfloat16",
            "DEEPINFER_CONFORMANCE_SHAPES": "all",
            "DEEPINFER_CONFORMANCE_FULL": "1" if full else "0",
        }
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                 "deepinfer.backends.testing", f"--junitxml={report}"],
                cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout_s} s"}
        summary: dict[str, Any] = {
            "ok": proc.returncode == 0,
            "seconds": round(time.monotonic() - started, 1),
        }
        suite = ET.parse(report).getroot().find("testsuite") if report.exists() else None
        if suite is not None:
            summary.update({k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")})
        if proc.returncode != 0:
            summary["tail"] = proc.stdout[-3000:]
        return summary


def _paged_decode_inputs(ops: Any, batch: int, context: int, queries: int) -> tuple[Any, ...]:
    import torch

    spec = ops.kv_cache_spec(LATENT, ROPE, torch.bfloat16)
    per_req = -(-context // spec.block_size)
    cache = spec.allocate(batch * per_req, "cuda")
    cache[0].normal_()
    table = torch.randperm(batch * per_req, device="cuda", dtype=torch.int32).view(batch, per_req)
    tokens = batch * queries
    q_nope = torch.randn(tokens, HEADS, LATENT, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.randn(tokens, HEADS, ROPE, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, tokens + 1, queries, dtype=torch.int32, device="cuda")
    return q_nope, q_pe, cache, table, seq_lens, qsl


Runner = Callable[..., None]  # run(name, shape, cost, fn, reps=...)


def _bench_attention(ops: Any, run: Runner) -> None:
    import torch

    scale = (NOPE + ROPE) ** -0.5
    for queries in (1, 2):
        q_nope, q_pe, cache, table, seq_lens, qsl = _paged_decode_inputs(ops, 64, 4096, queries)
        run(
            "mla_decode" if queries == 1 else "mla_decode_mtp",
            f"B=64 ctx=4096 H=128 L+R=576 q/req={queries}",
            mla_decode_cost(64, 4096, queries),
            lambda q_nope=q_nope, q_pe=q_pe, cache=cache, table=table, seq_lens=seq_lens, qsl=qsl, n=queries: (
                ops.mla_decode(q_nope, q_pe, cache, table, seq_lens, qsl, n, scale)
            ),
        )
    prompt = 4096
    q = torch.randn(prompt, HEADS, NOPE + ROPE, dtype=torch.bfloat16, device="cuda")
    k = torch.randn_like(q)
    v = torch.randn(prompt, HEADS, V_HEAD, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, prompt], dtype=torch.int32, device="cuda")
    run("mla_prefill", f"1 x {prompt}-token prompt H=128 192/128", mla_prefill_cost(prompt),
        lambda: ops.mla_prefill(q, k, v, cu, cu, prompt, prompt, scale))  # fmt: skip


def _bench_streaming_ops(ops: Any, run: Runner, tokens: int) -> None:
    """KV cache, norms, rope and activation at a prefill batch of ``tokens``."""
    import torch

    (cache,) = ops.kv_cache_spec(LATENT, ROPE, torch.bfloat16).allocate(tokens // 64 + 1, "cuda")
    kv_c = torch.randn(tokens, LATENT, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.randn(tokens, ROPE, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(tokens, device="cuda")
    row_bytes = (LATENT + ROPE) * BF16
    run("kv_cache_write", f"T={tokens} 512+64", streaming_cost(2 * tokens * row_bytes),
        lambda: ops.kv_cache_write(kv_c, k_pe, (cache,), slots))  # fmt: skip
    run("kv_cache_gather", f"N={tokens} 512+64", streaming_cost(2 * tokens * row_bytes),
        lambda: ops.kv_cache_gather((cache,), slots, LATENT))  # fmt: skip
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    res = torch.randn_like(x)
    w = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    run(
        "rms_norm",
        f"T={tokens} D={HIDDEN}",
        streaming_cost(2 * x.numel() * BF16),
        lambda: ops.rms_norm(x, w, 1e-6),
    )
    run("add_rms_norm", f"T={tokens} D={HIDDEN}", streaming_cost(4 * x.numel() * BF16),
        lambda: ops.add_rms_norm(x, res, w, 1e-6))  # fmt: skip
    q_pe = torch.randn(tokens, HEADS, ROPE, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 163840, (tokens,), device="cuda")
    cos_sin = torch.randn(163840, ROPE, device="cuda")
    rope_bytes = 2 * (q_pe.numel() + k_pe.numel()) * BF16 + tokens * ROPE * 4
    run("rope", f"T={tokens} H=128 R=64", streaming_cost(rope_bytes),
        lambda: ops.rope(q_pe, k_pe, positions, cos_sin, True))  # fmt: skip
    gate_up = torch.randn(tokens * TOP_K // 4, 2 * EXPERT_INTER, dtype=torch.bfloat16, device="cuda")
    run("silu_and_mul", f"rows={gate_up.shape[0]} I={EXPERT_INTER}", streaming_cost(1.5 * gate_up.numel() * BF16),
        lambda: ops.silu_and_mul(gate_up))  # fmt: skip


def _bench_moe(ops: Any, run: Runner, tokens: int, reps: int) -> None:
    """Routing, the fused expert MLP at a prefill and a decode batch, and one grouped GEMM."""
    import torch

    w13 = torch.randn(EXPERTS, 2 * EXPERT_INTER, HIDDEN, dtype=torch.bfloat16, device="cuda") * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, EXPERT_INTER, dtype=torch.bfloat16, device="cuda") * EXPERT_INTER**-0.5
    bias = torch.randn(EXPERTS, device="cuda") * 0.01
    route_args = (TOP_K, N_GROUP, TOPK_GROUP, "sigmoid", "noaux_tc", True, 2.5)
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    run("moe_route", f"T={tokens} E=256 noaux_tc", streaming_cost(logits.numel() * 4 + tokens * TOP_K * 8),
        lambda: ops.moe_route(logits, bias, *route_args))  # fmt: skip
    for batch, name in ((tokens, "fused_moe"), (64, "fused_moe_decode")):
        weights, ids = ops.moe_route(logits[:batch], bias, *route_args)
        touched = int(torch.unique(ids).numel())
        hidden = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
        run(name, f"T={batch} E=256 top8 {HIDDEN}/{EXPERT_INTER} ({touched} experts)",
            fused_moe_cost(batch, touched),
            lambda hidden=hidden, weights=weights, ids=ids: ops.fused_moe(hidden, w13, w2, weights, ids),
            reps=max(3, reps // 2))  # fmt: skip
    sizes = torch.full((EXPERTS,), tokens * TOP_K // EXPERTS, device="cuda")
    rows = torch.randn(tokens * TOP_K, HIDDEN, dtype=torch.bfloat16, device="cuda")
    flops = 2.0 * rows.shape[0] * 2 * EXPERT_INTER * HIDDEN
    run("grouped_gemm", f"{rows.shape[0]} rows E=256 {HIDDEN}->{2 * EXPERT_INTER}",
        Cost(w13.numel() * BF16 + rows.numel() * BF16 * 2, flops, "compute"),
        lambda: ops.grouped_gemm(rows, w13, sizes), reps=max(3, reps // 2))  # fmt: skip


def _bench_sampling(ops: Any, run: Runner, batch: int) -> None:
    """Sampling at a decode batch over the V3 vocabulary, every filter on."""
    import torch

    logits = torch.randn(batch, VOCAB, device="cuda") * 3
    params = (
        torch.full((batch,), 0.7, device="cuda"),
        torch.full((batch,), 50, dtype=torch.int32, device="cuda"),
        torch.full((batch,), 0.9, device="cuda"),
        torch.full((batch,), 0.05, device="cuda"),
        torch.arange(batch, device="cuda"),
        torch.zeros(batch, dtype=torch.int64, device="cuda"),
    )
    run("sample", f"B={batch} V={VOCAB} T=0.7 k=50 p=0.9 min_p=0.05", streaming_cost(logits.numel() * 4),
        lambda: ops.sample(logits, *params))  # fmt: skip


def bench_ops(ops: Any, ceilings: Ceilings, reps: int) -> list[OpResult]:
    """Time every op at DeepSeek-V3 shapes (each group's tensors are freed before the next)."""
    results: list[OpResult] = []

    def run(name: str, shape: str, cost: Cost, fn: Callable[[], Any], reps: int = reps) -> None:
        results.append(measure(name, shape, median_ms(fn, 2, reps), cost, ceilings))
        print(f"  {name} [{shape}]: {results[-1].ms:.4f} ms", flush=True)

    _bench_attention(ops, run)
    _bench_streaming_ops(ops, run, tokens=4096)
    _bench_moe(ops, run, tokens=4096, reps=reps)
    _bench_sampling(ops, run, batch=64)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per op (median)")
    parser.add_argument("--skip-conformance", action="store_true", help="do not run the conformance suite")
    parser.add_argument("--conformance-full", action="store_true",
                        help="conformance MoE cases at the real V3 sizes (slow: ~45 GB of CPU reference weights)")  # fmt: skip
    parser.add_argument("--conformance-timeout", type=int, default=180, help="seconds")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            f"bench/device_nvidia.py needs a CUDA GPU: torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}) sees none. Run it on a GPU runner.",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    sys.path.insert(0, str(REPO_ROOT))
    import triton

    from deepinfer.backends.registry import load_backend

    device = torch.cuda.get_device_name(0)
    print(f"{device} (sm{''.join(map(str, torch.cuda.get_device_capability(0)))}), torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)  # fmt: skip
    ceilings = measure_ceilings(args.reps)
    print(f"ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    conformance: dict[str, Any] = {"skipped": True}
    if not args.skip_conformance:
        conformance = run_conformance(args.conformance_full, args.conformance_timeout)
        print(f"conformance: {conformance}", flush=True)
    ops = load_backend("deepinfer.ops_cuda")
    results = bench_ops(ops, ceilings, args.reps)
    goals = targets({r.name: r for r in results}, ceilings)
    print(format_table(results, goals))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "device": device,
                "capability": list(torch.cuda.get_device_capability(0)),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "ceilings": asdict(ceilings),
                "conformance": conformance,
                "ops": [{**asdict(r), "cost": asdict(r.cost)} for r in results],
                "targets": [{**asdict(g), "met": g.met} for g in goals],
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
