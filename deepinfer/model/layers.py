"""Small model building blocks: linear layers (high precision or quantised), RMSNorm, the dense SwiGLU MLP.

Weights are allocated uninitialised (the loader fills every one of them and checks that it did).
Every accelerator-specific computation goes through the op interface (``deepinfer.backends.ops``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.backends import ops
from deepinfer.model.weight_plan import LinearQuant, WeightPlan


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; weight [out, in] as in nn.Linear."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A linear layer whose weight stays block-scaled FP8: ``y = x @ dequantize(weight, weight_scale).T
    (+ bias)`` in x's dtype.

    weight: [out, in] float8_e4m3fn; weight_scale: [ceil(out / bn), ceil(in / bk)] float32 (the
    checkpoint's ``weight_scale_inv``); bias: [out] in the model dtype. W8A16 runs ``ops.fp8_linear``
    on x as it is; W8A8 (``quant.w8a8``, chips that multiply FP8) quantises x per row and 1 x bk group
    with ``ops.quant_fp8_group`` (power-of-two scales, rounded up, for ue8m0 checkpoints, as DeepSeek's
    ``act_quant``) and runs ``ops.fp8_linear_w8a8``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: LinearQuant,
    ) -> None:
        super().__init__()
        fmt = quant.fmt
        if fmt.kind != "fp8":
            raise ValueError(f"QuantLinear keeps fp8 block-scaled weights, got {fmt.name}")
        self.fmt, self.w8a8 = fmt, quant.w8a8
        self.block = tuple(fmt.block)
        self.out_features = out_features
        self.weight = empty_param(out_features, in_features, dtype=fmt.values_dtype, device=device)
        self.weight_scale = empty_param(
            *fmt.scale_shape(out_features, in_features), dtype=fmt.scale_dtype, device=device
        )
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.w8a8:
            values, scale = ops.quant_fp8_group(x2, self.block[1], self.fmt.scale_fmt == "ue8m0")
            y = ops.fp8_linear_w8a8(
                values, scale, self.weight, self.weight_scale, self.block, self.bias, x.dtype
            )
        else:
            y = ops.fp8_linear(x2, self.weight, self.weight_scale, self.block, self.bias)
        return y.view(*lead, self.out_features)


def linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    quant: LinearQuant | None = None,
) -> Linear | QuantLinear:
    """A ``QuantLinear`` when ``quant`` is given, else a high-precision ``Linear``."""
    if quant is None:
        return Linear(in_features, out_features, bias, dtype, device)
    return QuantLinear(in_features, out_features, bias, dtype, device, quant)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(hidden, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """``(rms_norm(x + residual), x + residual)``."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class MLP(nn.Module):
    """Dense SwiGLU MLP with gate and up projections merged into one [2I, D] weight (``gate_up_proj``).

    ``prefix`` is the module's checkpoint name (``model.layers.3.mlp.``, ``...mlp.shared_experts.``);
    with a ``plan`` its projections stay quantised where the plan says so. A quantised gate/up pair
    whose split (I rows) does not fall on a block boundary cannot share one scale grid: it is kept as
    two FP8 projections ``gate_proj`` and ``up_proj`` (logged once).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str,
        plan: WeightPlan | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        gate, up, down = (f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down"))
        merged = None if plan is None else plan.merged_linear((gate, up), (intermediate, intermediate))
        self.gate_up_proj: nn.Module | None = None
        self.gate_proj: nn.Module | None = None
        self.up_proj: nn.Module | None = None
        if plan is not None and merged is None and (plan.linear(gate) or plan.linear(up)):
            rows = (plan.linear(gate) or plan.linear(up)).fmt.block[0]  # type: ignore[union-attr]
            plan.note(
                f"gate_proj and up_proj kept as two projections (not merged into gate_up_proj) where the "
                f"intermediate size {intermediate} is not a multiple of the {rows}-row block"
            )
            self.gate_proj = linear(hidden, intermediate, False, dtype, device, plan.linear(gate))
            self.up_proj = linear(hidden, intermediate, False, dtype, device, plan.linear(up))
        else:
            self.gate_up_proj = linear(hidden, 2 * intermediate, False, dtype, device, merged)
        self.down_proj = linear(
            intermediate, hidden, False, dtype, device, plan.linear(down) if plan else None
        )

    @property
    def merged(self) -> bool:
        return self.gate_up_proj is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(ops.silu_and_mul(gate_up))
