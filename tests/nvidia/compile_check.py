"""Compile every ops_cuda kernel ahead of time for a GPU architecture, on a host without a GPU.

The interpreter checks what kernels compute, not whether Triton can compile them for a GPU. This tool
calls every op at DeepSeek-V3 shapes on ``meta`` tensors (no memory, no device), records each kernel
launch (argument types, constexprs, warps, stages) instead of running it, and compiles the recorded
launches to cubin with ``triton.compile`` for the requested architecture, using the launch
configurations the ops pick for a device of that architecture (SM count, shared memory). It reports,
per kernel, the shared memory it needs against the device's limit and the registers ptxas spills.

    python -m tests.nvidia.compile_check --arch 90 --dtype bfloat16   # one JSON line per kernel

Must run without TRITON_INTERPRET (kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer.ops_cuda import runtime

ARCH_LIMITS = {
    80: runtime.DeviceLimits(sm_count=108, shared_memory=163 * 1024, capability=(8, 0)),
    90: runtime.DeviceLimits(sm_count=132, shared_memory=227 * 1024, capability=(9, 0)),
    100: runtime.DeviceLimits(sm_count=148, shared_memory=227 * 1024, capability=(10, 0)),
}
TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                 torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip


def _launches(limits: runtime.DeviceLimits, dtype: torch.dtype) -> list[tuple[Any, list, dict]]:
    """Call every op on meta tensors and return the kernel launches they make: (kernel, args, kwargs)."""
    import triton

    from deepinfer.backends.quant import WeightFormat
    from deepinfer.ops_cuda import OPS, grouped_gemm, mla_decode, mla_prefill, quant_linear, quant_moe

    recorded: list[tuple[Any, list, dict]] = []

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, list(args), kwargs))

    triton.runtime.jit.JITFunction.run = record
    runtime.device_limits = lambda device: limits
    for module in (mla_decode, mla_prefill, grouped_gemm, quant_linear, quant_moe):
        module.device_limits = runtime.device_limits
    checked = runtime.check_device
    for name, module in list(sys.modules.items()):
        if name.startswith("deepinfer.ops_cuda.") and getattr(module, "check_device", None) is checked:
            module.check_device = lambda *tensors: tensors[0].device  # meta tensors stand in for CUDA ones

    def t(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device="meta")

    tokens, heads, latent, rope_dim, hidden, inter, experts = 4096, 128, 512, 64, 7168, 2048, 256
    ops: dict[str, Callable[..., Any]] = {name: OPS.implementation(name) for name in OPS._impls}
    ops["rms_norm"](t(tokens, hidden), t(hidden), 1e-6)
    ops["add_rms_norm"](t(tokens, hidden), t(tokens, hidden), t(hidden), 1e-6)
    ops["silu_and_mul"](t(tokens, 2 * inter))
    ops["rope"](t(tokens, heads, rope_dim), t(tokens, rope_dim), t(tokens, dt=torch.int64),
                t(163840, rope_dim, dt=torch.float32), True)  # fmt: skip
    cache = ops["kv_cache_spec"](latent, rope_dim, dtype).allocate(64 * 64, "meta")
    ops["kv_cache_write"](t(tokens, latent), t(tokens, rope_dim), cache, t(tokens, dt=torch.int64))
    ops["kv_cache_gather"](cache, t(tokens, dt=torch.int64), latent)
    for queries in (1, 2):
        ops["mla_decode"](t(64 * queries, heads, latent), t(64 * queries, heads, rope_dim), cache,
                          t(64, 64, dt=torch.int32), t(64, dt=torch.int32), t(65, dt=torch.int32), queries, 0.1)  # fmt: skip
    # One long request with a sliding window: split KV, so the merge kernel runs too.
    ops["mla_decode"](t(1, heads, latent), t(1, heads, rope_dim), cache, t(1, 64, dt=torch.int32),
                      t(1, dt=torch.int32), t(2, dt=torch.int32), 1, 0.1, 128)  # fmt: skip
    # Deterministic mode: fixed-position splits merged in order, by their own merge kernel.
    OPS.deterministic_implementation("mla_decode")(
        t(1, heads, latent), t(1, heads, rope_dim), cache, t(1, 64, dt=torch.int32),
        t(1, dt=torch.int32), t(2, dt=torch.int32), 1, 0.1)  # fmt: skip
    ops["mla_prefill"](t(tokens, heads, 192), t(tokens, heads, 192), t(tokens, heads, 128),
                       t(2, dt=torch.int32), t(2, dt=torch.int32), tokens, tokens, 0.1, 128)  # fmt: skip
    ops["moe_route"](t(tokens, experts, dt=torch.float32), t(experts, dt=torch.float32), 8, 8, 4, "sigmoid",
                     "noaux_tc", True, 2.5)  # fmt: skip
    ops["fused_moe"](t(tokens, hidden), t(experts, 2 * inter, hidden), t(experts, hidden, inter),
                     t(tokens, 8, dt=torch.float32), t(tokens, 8, dt=torch.int32))  # fmt: skip
    ops["sample"](t(64, 129280, dt=torch.float32), t(64, dt=torch.float32), t(64, dt=torch.int32),
                  t(64, dt=torch.float32), t(64, dt=torch.float32), t(64, dt=torch.int64), t(64, dt=torch.int64))  # fmt: skip
    ops["apply_token_bitmask"](t(64, 129280, dt=torch.float32), t(64, 4040, dt=torch.int32))
    # Quantised weights (FP8 loaded natively from SM89 on, as bytes decoded by bit operations before).
    fp8, f32, u8 = torch.float8_e4m3fn, torch.float32, torch.uint8
    weight, scale = t(hidden, hidden, dt=fp8), t(56, 56, dt=f32)
    ops["quant_fp8_group"](t(tokens, hidden), 128, True)
    ops["fp8_linear"](t(tokens, hidden), weight, scale, (128, 128), None)
    ops["fp8_linear"](t(1, hidden), weight, scale, (128, 128), None)  # decode tiles
    ops["fp8_linear"](t(tokens, hidden), weight, t(224, 224, dt=f32), (32, 32), None)  # V4.1 blocks
    ops["fp8_linear_w8a8"](
        t(tokens, hidden, dt=fp8), t(tokens, 56, dt=f32), weight, scale, (128, 128), None, dtype
    )
    route = (t(tokens, 8, dt=f32), t(tokens, 8, dt=torch.int32))
    ops["fused_moe_quant"](t(tokens, hidden), t(experts, 2 * inter, hidden, dt=fp8), t(experts, 32, 56, dt=f32),
                           t(experts, hidden, inter, dt=fp8), t(experts, 56, 16, dt=f32),
                           WeightFormat("fp8", (128, 128)), *route)  # fmt: skip
    ops["fused_moe_quant"](t(tokens, hidden), t(experts, 2 * inter, hidden // 2, dt=u8),
                           t(experts, 2 * inter, hidden // 32, dt=u8), t(experts, hidden, inter // 2, dt=u8),
                           t(experts, hidden, inter // 32, dt=u8), WeightFormat("mxfp4", (1, 32), "ue8m0"), *route)  # fmt: skip
    return recorded


def _specialise(kernel: Any, args: list, kwargs: dict) -> tuple[dict[str, str], dict[str, Any], dict, dict]:
    """Signature, constexprs, options and attributes as Triton's launcher would derive them: pointers
    (fresh allocations) and integers that are multiples of 16 are marked 16-divisible."""
    names = kernel.arg_names
    constexpr_names = {names[i] for i in kernel.constexprs}
    values = dict(zip(names, args))
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return signature, constexprs, options, attrs


def compile_all(arch: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    limits = ARCH_LIMITS[arch]
    reports, seen = [], set()
    for kernel, args, kwargs in _launches(limits, dtype):
        signature, constexprs, options, attrs = _specialise(kernel, args, dict(kwargs))
        key = (kernel.fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        started = time.monotonic()
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # where Triton prints the ptxas log
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", arch, 32),
                options={**options, "ptx_options": "-v"},
            )
        spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log.getvalue()))
        reports.append({
            "kernel": kernel.fn.__name__,
            "constexprs": {k: v if isinstance(v, (bool, int, float, str)) else str(v)  # tl dtypes by name
                           for k, v in constexprs.items() if k.isupper()},
            **options,
            "shared": compiled.metadata.shared,
            "shared_limit": limits.shared_memory,
            "spill_store_bytes": spills,
            "seconds": round(time.monotonic() - started, 1),
        })  # fmt: skip
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=sorted(ARCH_LIMITS), required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: ahead-of-time compilation needs JIT kernels")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    for report in compile_all(args.arch, getattr(torch, args.dtype)):
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
