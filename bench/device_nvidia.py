"""GPU benchmark of the NVIDIA backend (deepinfer.ops_cuda) at DeepSeek-V3 shapes.

On one GPU it measures two ceilings, the device copy bandwidth (a large tensor copy, bytes read plus
written) and the dense bf16 matmul rate; runs the conformance suite (bfloat16); then times every op at
DeepSeek-V3 decode and prefill shapes and reports the bandwidth or FLOP rate it achieves as a fraction
of the measured ceiling, as a table and as JSON. About four minutes on an H200, well under six.

    python bench/device_nvidia.py [--out bench/results/device_nvidia.json] [--skip-conformance] [--quant-only]

Targets reported: mla_decode >= 60% of copy bandwidth (batch 64, context 4096, 128 heads, 512 + 64);
fused_moe >= 40% of the dense bf16 matmul rate (4096 tokens, 256 experts, top-8, 7168 / 2048);
sampling < 5% of a decode step, the step being bounded below by 61 layers of mla_decode at that batch;
the block-scaled W8A8 Triton GEMM (M=4096, N=K=7168, 128x128 blocks) >= 60% of the chip's FP8 dense
peak (datasheet, by device name; the measured ``torch._scaled_mm`` rate is recorded beside it). The
quantised-weight ops (issue 29) are also timed at V3 shapes: quant_fp8_group, fp8_linear (W8A16) and
fp8_linear_w8a8 (DeepGEMM when installed), fused_moe_quant with FP8 and with MXFP4 experts;
``--quant-only`` runs just those (about a minute).
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
W8A8_TARGET = 0.60  # of the FP8 dense peak

# FP8 dense tensor-core peak (no sparsity), NVIDIA datasheets, by a fragment of the device name (first
# match wins: the PCIe part before the generic name).
FP8_DENSE_PEAK_FLOPS = (
    ("H100 PCIe", 1513e12),
    ("H100", 1979e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 1979e12),
    ("H800", 1979e12),
    ("L40S", 733e12),
    ("L4", 242e12),
    ("B200", 4500e12),
)


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


def fp8_dense_peak(device_name: str) -> float | None:
    """The FP8 dense peak FLOP/s of a device by its name, or None for a device not in the table."""
    for fragment, peak in FP8_DENSE_PEAK_FLOPS:
        if fragment in device_name:
            return peak
    return None


def w8a8_gemm_cost(m: int, n: int, k: int, block: int = 128) -> Cost:
    """Block-scaled FP8 GEMM: FP8 operands and float32 scales read once, a bf16 [m, n] written."""
    blocks_k = -(-k // block)
    scales = 4 * (m * blocks_k + -(-n // block) * blocks_k)
    return Cost(m * k + n * k + scales + m * n * BF16, 2.0 * m * n * k, "compute")


def fused_moe_quant_cost(tokens: int, experts_touched: int, weight_bits: float) -> Cost:
    """``fused_moe_cost`` with expert weights of ``weight_bits`` bits (scales included: 8.0 + 32 / 128^2
    for FP8 128x128 blocks, 4 + 8 / 32 for MXFP4); activations bf16."""
    bf16 = fused_moe_cost(tokens, experts_touched)
    weights = experts_touched * 3 * HIDDEN * EXPERT_INTER * weight_bits / 8
    bf16_weights = experts_touched * 3 * HIDDEN * EXPERT_INTER * BF16
    return Cost(bf16.bytes - bf16_weights + weights, bf16.flops, bf16.bound)


def quant_targets(
    results: dict[str, OpResult], fp8_peak: float | None, fp8_measured: float | None
) -> list[Target]:
    """The W8A8 goal: the Triton kernel's rate over the datasheet FP8 peak (over the measured
    ``torch._scaled_mm`` rate when the device is not in the table; none when neither is known)."""
    gemm = results.get("fp8_linear_w8a8_triton")
    if gemm is None:
        return []
    if fp8_peak is not None:
        return [Target("fp8_linear_w8a8_triton fraction of FP8 dense peak", gemm.tflop_per_s * 1e12 / fp8_peak,
                       W8A8_TARGET, at_least=True)]  # fmt: skip
    if fp8_measured is not None:
        return [Target("fp8_linear_w8a8_triton fraction of measured FP8 matmul rate",
                       gemm.tflop_per_s * 1e12 / fp8_measured, W8A8_TARGET, at_least=True)]  # fmt: skip
    return []


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


def _fp8_matmul_flops(n: int, reps: int) -> float | None:
    """The rate of ``torch._scaled_mm`` on n^3 FP8 operands (per-tensor scales, bf16 out), or None when
    this torch/GPU has no FP8 matmul."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    try:
        ms = median_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), 3, reps)
    except (RuntimeError, TypeError) as error:
        print(f"torch._scaled_mm unavailable: {error}", flush=True)
        return None
    return 2.0 * n**3 / (ms * 1e-3)


def _random_fp8(shape: tuple[int, ...], scale: float, chunk: int = 16) -> Any:
    """Random e4m3 values of roughly N(0, scale^2), written in chunks of the first dimension (the
    float temporaries of a whole V3 expert stack would take tens of GB)."""
    import torch

    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
    for i in range(0, shape[0], chunk):
        part = out[i : i + chunk]
        part.copy_(
            (torch.randn(part.shape, dtype=torch.bfloat16, device="cuda") * scale).to(torch.float8_e4m3fn)
        )
    return out


def _expert_pair(kind: str, n: int, k: int) -> tuple[Any, Any, Any]:
    """A V3-sized expert stack [EXPERTS, n, k] as (values, scale, WeightFormat): FP8 128x128 with float32
    scales, or MXFP4 (random nibbles, e8m0 exponents 2^-8 .. 2^-5)."""
    import torch

    from deepinfer.backends.quant import WeightFormat

    if kind == "fp8":
        fmt = WeightFormat("fp8", (128, 128))
        values = _random_fp8((EXPERTS, n, k), 64.0)
        scale = torch.rand(EXPERTS, *fmt.scale_shape(n, k), device="cuda") * 1e-3 + 5e-4
        return values, scale, fmt
    fmt = WeightFormat("mxfp4", (1, 32), "ue8m0")
    values = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device="cuda")
    scale = torch.randint(119, 123, (EXPERTS, n, k // 32), dtype=torch.uint8, device="cuda")
    return values, scale, fmt


def _bench_quant_dense(ops: Any, run: Runner, tokens: int) -> str:
    """quant_fp8_group, W8A8 (the op, then the Triton kernel itself) and W8A16 at N = K = 7168; returns
    what the W8A8 op ran (DeepGEMM or Triton)."""
    import torch

    from deepinfer.ops_cuda import quant_linear

    n = k = HIDDEN
    block = (128, 128)
    weight = _random_fp8((n, k), 64.0)
    scale = torch.rand(n // 128, k // 128, device="cuda") * 1e-3 + 5e-4
    x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
    run("quant_fp8_group", f"T={tokens} K={k} group 128 ue8m0", streaming_cost(tokens * k * 3 + tokens * k // 128 * 4),
        lambda: ops.quant_fp8_group(x, 128, True))  # fmt: skip
    xq, xs = ops.quant_fp8_group(x, 128, True)
    capability = torch.cuda.get_device_capability(0)
    deep_gemm = quant_linear.deep_gemm_module() is not None and quant_linear.deep_gemm_applies(
        capability, block, torch.bfloat16, n, k
    )
    run("fp8_linear_w8a8", f"M={tokens} N=K={k} 128x128 ({'DeepGEMM' if deep_gemm else 'Triton'})",
        w8a8_gemm_cost(tokens, n, k), lambda: ops.fp8_linear_w8a8(xq, xs, weight, scale, block, None, torch.bfloat16))  # fmt: skip
    run("fp8_linear_w8a8_triton", f"M={tokens} N=K={k} 128x128 Triton", w8a8_gemm_cost(tokens, n, k),
        lambda: quant_linear.launch_block_scaled_gemm(xq, xs, weight, scale, block, None, torch.bfloat16,
                                                      quant_linear.fp8_dot_supported(x.device)))  # fmt: skip
    w8a16 = w8a8_gemm_cost(tokens, n, k)
    run("fp8_linear", f"M={tokens} N=K={k} 128x128 W8A16 bf16",
        Cost(w8a16.bytes + tokens * k, w8a16.flops, "compute"), lambda: ops.fp8_linear(x, weight, scale, block, None))  # fmt: skip
    decode = x[:64]
    run("fp8_linear_decode", f"M=64 N=K={k} 128x128 W8A16 bf16",
        Cost(n * k + 64 * (k + n) * BF16, 2.0 * 64 * n * k, "memory"), lambda: ops.fp8_linear(decode, weight, scale, block, None))  # fmt: skip
    return "DeepGEMM" if deep_gemm else "Triton"


def bench_quant(
    ops: Any, ceilings: Ceilings, reps: int, tokens: int = 4096
) -> tuple[list[OpResult], dict[str, Any]]:
    """The quantised-weight ops at DeepSeek-V3 shapes; returns the results and what the W8A8 op ran
    (DeepGEMM or Triton)."""
    import torch

    results: list[OpResult] = []

    def run(name: str, shape: str, cost: Cost, fn: Callable[[], Any], reps: int = reps) -> None:
        results.append(measure(name, shape, median_ms(fn, 2, reps), cost, ceilings))
        print(f"  {name} [{shape}]: {results[-1].ms:.4f} ms", flush=True)

    backend = _bench_quant_dense(ops, run, tokens)
    bias = torch.randn(EXPERTS, device="cuda") * 0.01
    route_args = (TOP_K, N_GROUP, TOPK_GROUP, "sigmoid", "noaux_tc", True, 2.5)
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    for kind, bits in (("fp8", 8.0 + 32 / 128**2), ("mxfp4", 4.0 + 8 / 32)):
        w13, s13, fmt = _expert_pair(kind, 2 * EXPERT_INTER, HIDDEN)
        w2, s2, _ = _expert_pair(kind, HIDDEN, EXPERT_INTER)
        for batch, name in ((tokens, f"fused_moe_{kind}"), (64, f"fused_moe_{kind}_decode")):
            weights, ids = ops.moe_route(logits[:batch], bias, *route_args)
            touched = int(torch.unique(ids).numel())
            hidden = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
            run(name, f"T={batch} E=256 top8 {HIDDEN}/{EXPERT_INTER} {fmt.name} ({touched} experts)",
                fused_moe_quant_cost(batch, touched, bits),
                lambda hidden=hidden, weights=weights, ids=ids, w13=w13, s13=s13, w2=w2, s2=s2, fmt=fmt: (
                    ops.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights, ids)),
                reps=max(3, reps // 2))  # fmt: skip
        del w13, s13, w2, s2
    return results, {"fp8_linear_w8a8_backend": backend}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per op (median)")
    parser.add_argument("--skip-conformance", action="store_true", help="do not run the conformance suite")
    parser.add_argument("--conformance-full", action="store_true",
                        help="conformance MoE cases at the real V3 sizes (slow: ~45 GB of CPU reference weights)")  # fmt: skip
    parser.add_argument("--conformance-timeout", type=int, default=180, help="seconds")
    parser.add_argument("--quant-only", action="store_true",
                        help="only the quantised-weight ops (no conformance, no other op); "
                             "default --out bench/results/device_nvidia_quant.json")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quant_only and args.out == DEFAULT_OUT:  # a partial run keeps the full results file
        args.out = DEFAULT_OUT.with_name("device_nvidia_quant.json")

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
    if not args.skip_conformance and not args.quant_only:
        conformance = run_conformance(args.conformance_full, args.conformance_timeout)
        print(f"conformance: {conformance}", flush=True)
    ops = load_backend("deepinfer.ops_cuda")
    results = [] if args.quant_only else bench_ops(ops, ceilings, args.reps)
    goals = [] if args.quant_only else targets({r.name: r for r in results}, ceilings)
    fp8_peak = fp8_dense_peak(device)
    fp8_measured = _fp8_matmul_flops(8192, args.reps)
    print(f"FP8 dense peak {'unknown' if fp8_peak is None else f'{fp8_peak / 1e12:.0f} TFLOP/s (datasheet)'}, "
          f"torch._scaled_mm {'n/a' if fp8_measured is None else f'{fp8_measured / 1e12:.0f} TFLOP/s'}", flush=True)  # fmt: skip
    quant_results, quant_info = bench_quant(ops, ceilings, args.reps)
    results += quant_results
    goals += quant_targets({r.name: r for r in quant_results}, fp8_peak, fp8_measured)
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
                "fp8_dense_peak_flops_per_s": fp8_peak,
                "fp8_scaled_mm_flops_per_s": fp8_measured,
                **quant_info,
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
