"""Which quantised checkpoint weights stay in low precision in memory, and how they are multiplied.

The loader makes one ``WeightPlan`` per model load from the checkpoint (``ModelConfig.weight_format``
and ``expert_weight_format``, and the names of the weights stored with a ``*_scale_inv`` companion),
the ``weights`` choice (``EngineConfig.weights``: ``--weights`` on the command line) and the active op
backend; the model's layers ask it, by checkpoint name, whether to allocate a quantised layer.

``weights``:

- ``"as-stored"`` (default): keep each quantised weight as its ``(values, scale)`` pair wherever the
  active backend has its own kernel for the op that consumes it (``fp8_linear`` / ``fp8_linear_w8a8``
  for linear layers, ``fused_moe_quant`` for routed experts). On the reference backend, the
  numerical oracle, they are always kept. Where the backend would only run the reference
  implementation (dequantise per call), the weight is dequantised once at load instead, and the
  plan's ``describe()`` says so. On a chip that multiplies FP8 (its chip facts list FP8 math) with
  16-bit activations, linear layers quantise their input per 1 x bk group and run W8A8; otherwise
  W8A16 (activations stay in the model dtype).
- ``"bf16"`` / ``"fp32"``: dequantise every quantised weight at load into that dtype (the model's
  dtype must then be that dtype too).

Always high precision whatever the choice: embeddings, the LM head, norms, the router and its
correction bias, biases, and ``kv_b_proj`` (dequantised once at load: the absorbed MLA decode path
splits it into per-head factors, as DeepSeek's reference does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from deepinfer.backends.quant import WeightFormat
from deepinfer.logger import get_logger

if TYPE_CHECKING:
    from deepinfer.backends.registry import OpTable

logger = get_logger(__name__)

WeightsChoice = Literal["as-stored", "bf16", "fp32"]
WEIGHTS_CHOICES: tuple[str, ...] = ("as-stored", "bf16", "fp32")
DEQUANTISED_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SCALE_SUFFIX = (
    "_scale_inv"  # ``x.weight`` -> ``x.weight_scale_inv``; ``experts.gate_up_proj`` -> ``..._scale_inv``
)
REFERENCE_BACKEND = "deepinfer.backends.reference"

_EXPERT_WEIGHT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(?:\d+\.(?:gate_proj|up_proj|down_proj)\.weight|gate_up_proj|down_proj)"
)


def is_routed_expert_weight(name: str) -> bool:
    """A checkpoint name of a routed expert's weight (per-expert or fused layout)."""
    return _EXPERT_WEIGHT.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class LinearQuant:
    """How one quantised linear layer is kept: its stored format (kind "fp8") and whether it runs W8A8
    (``quant_fp8_group`` on the input, then ``fp8_linear_w8a8``) rather than W8A16 (``fp8_linear``)."""

    fmt: WeightFormat
    w8a8: bool = False


@dataclass(slots=True)
class WeightPlan:
    """The decisions for one load (see the module docstring).

    ``dense`` / ``experts``: the format kept in memory for linear layers / routed experts (None: not
    kept, dequantised at load or not quantised); ``quantised``: checkpoint weight names stored with
    a scale; ``reasons``: why a stored format is dequantised; ``notes``: per-layer decisions logged
    once each (unmerged projections, dequantised weights).
    """

    choice: WeightsChoice
    dtype: torch.dtype
    stored_dense: WeightFormat | None
    stored_experts: WeightFormat | None
    dense: WeightFormat | None
    experts: WeightFormat | None
    w8a8: bool
    quantised: frozenset[str]
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _expert_layers: frozenset[int] = frozenset()
    experts_unmergeable: str = ""  # set when per-expert FP8 tensors cannot merge (then dequantised)

    def __post_init__(self) -> None:
        layers = set()
        for name in self.quantised:
            m = _EXPERT_WEIGHT.fullmatch(name)
            if m is not None:
                layers.add(int(m.group(1)))
        self._expert_layers = frozenset(layers)

    def note(self, message: str) -> None:
        """Log a load decision once (the same decision for many layers is one line)."""
        if message not in self.notes:
            self.notes.append(message)
            logger.info("weights: %s", message)

    def linear(self, name: str) -> LinearQuant | None:
        """The quantised layout for the linear weight stored as checkpoint tensor ``name`` (None: high
        precision, dequantised at load if the checkpoint stores it quantised)."""
        if self.dense is None or name not in self.quantised:
            return None
        return LinearQuant(self.dense, self.w8a8)

    def merged_linear(self, names: tuple[str, ...], rows: tuple[int, ...]) -> LinearQuant | None:
        """The layout of one projection merged from several stored weights (``names``, ``rows`` output
        rows each, concatenated in that order), or None when the merge must not stay quantised:
        scale rows concatenate only when every part but the last ends on a block boundary."""
        specs = [self.linear(n) for n in names]
        if any(s is None for s in specs):
            return None
        spec = specs[0]
        assert spec is not None
        bn = spec.fmt.block[0]
        if any(r % bn for r in rows[:-1]):
            return None
        return spec

    def expert_format(self, layer: int, intermediate: int, fused: bool) -> WeightFormat | None:
        """The format routed experts of checkpoint layer ``layer`` stay in (None: high precision).
        Per-expert tensors are merged into w13 = [gate; up], which stays FP8 only when the
        intermediate size ``intermediate`` is a multiple of the block rows (else it is dequantised,
        with a log line); a fused checkpoint tensor is already one matrix and is kept as stored."""
        if self.experts is None or layer not in self._expert_layers:
            return None
        fmt = self.experts
        if fmt.kind == "fp8" and not fused and intermediate % fmt.block[0]:
            self.experts_unmergeable = (
                f"moe_intermediate_size {intermediate} is not a multiple of the {fmt.block[0]}-row block, so "
                "gate_proj and up_proj scales do not concatenate into w13"
            )
            self.note(
                f"routed experts dequantised to {_dtype_name(self.dtype)} at load: {self.experts_unmergeable}"
            )
            return None
        return fmt

    def describe(self) -> str:
        """The startup line's words, e.g. ``weights fp8 128x128 ue8m0 as stored (experts mxfp4)``."""
        if self.stored_dense is None and self.stored_experts is None:
            return f"weights {_dtype_name(self.dtype)} (checkpoint not quantised)"
        if self.choice != "as-stored":
            return f"weights dequantised to {_dtype_name(self.dtype)} (--weights {self.choice})"
        dtype = _dtype_name(self.dtype)
        if self.dense is not None:
            text = f"weights {self.dense.name} as stored, {'W8A8' if self.w8a8 else 'W8A16'}"
        else:
            text = f"weights {self.stored_dense.name if self.stored_dense else dtype} dequantised to {dtype} at load"
        experts = self.stored_experts
        experts_kept = self.experts is not None and not self.experts_unmergeable
        if experts is not None and (experts != self.stored_dense or experts_kept != (self.dense is not None)):
            kept = "as stored" if experts_kept else f"dequantised to {dtype} at load"
            why = f": {self.experts_unmergeable}" if self.experts_unmergeable else ""
            text += f" (experts {experts.name} {kept}{why})"
        return text + (f": {'; '.join(self.reasons)}" if self.reasons else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def has_kernel(table: OpTable, op: str) -> bool:
    """Whether the op table runs its own implementation of ``op`` (the reference backend always
    counts: it is the oracle)."""
    return table.backend == REFERENCE_BACKEND or op not in table.reference_fallbacks


def plan_weights(
    stored_dense: WeightFormat | None,
    stored_experts: WeightFormat | None,
    quantised: frozenset[str],
    choice: str,
    dtype: torch.dtype,
    table: OpTable,
    fp8_math: bool,
) -> WeightPlan:
    """Decide what stays quantised (module docstring). ``table``: the active op table; ``fp8_math``:
    whether the chip multiplies FP8 (``ChipFacts.fp8_tflops`` is not None)."""
    if choice not in WEIGHTS_CHOICES:
        raise ValueError(f"weights={choice!r} is not supported; supported: {', '.join(WEIGHTS_CHOICES)}")
    if choice != "as-stored" and dtype != DEQUANTISED_DTYPES[choice]:
        raise ValueError(
            f"weights={choice!r} dequantises into {_dtype_name(DEQUANTISED_DTYPES[choice])}, but the model "
            f"dtype is {_dtype_name(dtype)}: leave dtype 'auto' or give the same dtype"
        )
    dense = experts = None
    w8a8 = False
    reasons: list[str] = []
    if choice == "as-stored":
        backend = table.backend
        if stored_dense is not None:
            sixteen_bit = dtype in (torch.bfloat16, torch.float16)
            if fp8_math and sixteen_bit and has_kernel(table, "fp8_linear_w8a8"):
                dense, w8a8 = stored_dense, True
            elif has_kernel(table, "fp8_linear"):
                dense = stored_dense
            else:
                reasons.append(f"no fp8_linear kernel on {backend}")
        if stored_experts is not None:
            if has_kernel(table, "fused_moe_quant"):
                experts = stored_experts
            else:
                reasons.append(f"no fused_moe_quant kernel on {backend}")
    return WeightPlan(choice, dtype, stored_dense, stored_experts, dense, experts, w8a8, quantised, reasons)  # type: ignore[arg-type]
