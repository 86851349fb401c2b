"""On an Ascend NPU (DEEPINFER_TEST_ACCELERATOR=ascend, run by ci/ascend.sh): the quantised-weight ops
of deepinfer.ops_ascend on the device against the reference on the CPU. What the emulation cannot show:
that the kernels compute what their documentation says. On a 950: npu_dynamic_mx_quant (scale_alg 1) is
DeepSeek's act_quant bit for bit; npu_quant_matmul's G-B mode with f32 block scales and its MX mode with
the re-expressed ue8m0 scales match the dequantised product; on every chip: the byte decoders (integer
operations on the NPU) and the dequantise-then-matmul paths.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.backends.quant import WeightFormat, quantize_weight
from deepinfer.backends.registry import OpTable, load_backend
from tests.ascend.conftest import ON_ASCEND

pytestmark = pytest.mark.skipif(
    not ON_ASCEND, reason="needs an Ascend NPU (DEEPINFER_TEST_ACCELERATOR=ascend)"
)

DEVICE = "npu"


def on_device(ops: OpTable, device: str) -> list[tuple[str, Callable[[], None]]]:
    """The checks, each (name, run); ``device`` is where the Ascend ops run (the reference runs on the CPU)."""
    from deepinfer.ops_ascend import quant

    reference = load_backend("deepinfer.backends.reference")
    g = torch.Generator().manual_seed(0)

    def close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
        err = (out.cpu().float() - expected.float()).abs().max().item()
        assert err <= tol * expected.float().abs().max().item(), err

    def decoders() -> None:
        every = torch.arange(256, dtype=torch.uint8)
        got = quant.e4m3_to_float(every.view(torch.float8_e4m3fn).to(device)).cpu()
        want = every.view(torch.float8_e4m3fn).float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got.nan_to_num(7.0), want.nan_to_num(7.0)
        )

    def w8a16() -> None:
        for fmt, (n, k) in (
            (WeightFormat("fp8", (128, 128)), (200, 300)),
            (WeightFormat("fp8", (32, 32), "ue8m0"), (70, 90)),
        ):
            values, scale = quantize_weight(torch.randn(n, k, generator=g), fmt)
            x = torch.randn(5, k, generator=g).bfloat16()
            out = ops.fp8_linear(x.to(device), values.to(device), scale.to(device), fmt.block, None)
            close(out, reference.fp8_linear(x, values, scale, fmt.block, None), 2e-2)

    def act_quant() -> None:
        x = (torch.randn(9, 300, generator=g) * torch.logspace(-6, 2, 9)[:, None]).bfloat16()
        values, scale = ops.quant_fp8_group(x.to(device), 128, True)
        want_values, want_scale = reference.quant_fp8_group(x, 128, True)
        assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scale.cpu(), want_scale)

    def w8a8() -> None:
        for fmt, (n, k) in (
            (WeightFormat("fp8", (128, 128)), (256, 384)),
            (WeightFormat("fp8", (32, 32), "ue8m0"), (96, 160)),
        ):
            values, scale = quantize_weight(torch.randn(n, k, generator=g), fmt)
            x_values, x_scale = reference.quant_fp8_group(
                torch.randn(6, k, generator=g), fmt.block[1], fmt.scale_fmt == "ue8m0"
            )
            args = (x_values, x_scale, values, scale)
            out = ops.fp8_linear_w8a8(*(t.to(device) for t in args), fmt.block, None, torch.float32)
            close(out, reference.fp8_linear_w8a8(*args, fmt.block, None, torch.float32), 1e-4)

    def experts() -> None:
        for fmt, d, inter in (
            (WeightFormat("fp8", (128, 128)), 256, 128),
            (WeightFormat("mxfp4", (1, 32), "ue8m0"), 128, 64),
        ):
            w13, w13_scale = quantize_weight(torch.randn(4, 2 * inter, d, generator=g) * 0.3, fmt)
            w2, w2_scale = quantize_weight(torch.randn(4, d, inter, generator=g) * 0.3, fmt)
            hidden = torch.randn(6, d, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]).to(torch.int32)
            weights = torch.rand(6, 2, generator=g)
            args = (hidden, w13, w13_scale, w2, w2_scale)
            out = ops.fused_moe_quant(*(t.to(device) for t in args), fmt, weights.to(device), ids.to(device))
            close(out, reference.fused_moe_quant(*args, fmt, weights, ids), 3e-2)

    checks = [("decoders", decoders), ("w8a16", w8a16), ("experts", experts), ("w8a8", w8a8)]
    return checks + ([("act_quant", act_quant)] if quant.multiplies_fp8() else [])


@pytest.mark.parametrize("check", ["decoders", "w8a16", "experts", "w8a8", "act_quant"])
def test_quantised_ops_on_the_npu(check: str) -> None:
    ops = load_backend("deepinfer.ops_ascend")
    checks = dict(on_device(ops, DEVICE))
    if check not in checks:
        pytest.skip(f"{check}: the 950's op, not on this chip")
    checks[check]()
