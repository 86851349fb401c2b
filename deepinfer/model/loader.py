"""Load a standard Hugging Face checkpoint folder into ``DeepseekV3ForCausalLM``.

Reads ``config.json``, single or sharded ``*.safetensors`` (with ``model.safetensors.index.json``),
in DeepSeek's published per-expert layout or transformers 5's fused-expert layout (``gate_up_proj``
[E, 2I, D] with ``gate_up_proj_scale_inv``), and quantised weights as DeepSeek ships them: FP8 e4m3
with block scales (``weight_scale_inv``, float32 or float8_e8m0fnu) and V4's MXFP4 routed experts
(int8 [N, K / 2], two e2m1 values a byte, with e8m0 scales per 32). A ``WeightPlan``
(``deepinfer.model.weight_plan``) says which quantised weights stay as ``(values, scale)``
parameters (scales as float32 for fp8, uint8 e8m0 bytes for mxfp4, both exact) and which are
dequantised into the model dtype here.

Every floating parameter (FP8 values and float32 scales included) is poisoned with NaN before
loading, and every byte parameter (MXFP4 values and e8m0 scales, which have no NaN) is tracked row by
row, so any part the checkpoint did not provide is reported by name; unknown and mis-shaped tensors,
a quantised weight without its scale and a scale of the wrong grid are reported by name too.

Under expert parallelism (an ``ExpertShard``) a rank reads only the tensors it needs: expert tensors
of experts it does not hold are never opened (so their weights are never dequantised), and fused
expert tensors are read as slices of the experts it holds. ``model.load_stats`` says what was read.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from deepinfer.backends.quant import FP8_DTYPE, WeightFormat, dequantize
from deepinfer.logger import get_logger
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM, Target
from deepinfer.model.weight_plan import SCALE_SUFFIX, is_routed_expert_weight, plan_weights

if TYPE_CHECKING:
    from deepinfer.parallel.placement import ExpertShard

logger = get_logger(__name__)

IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """The folder is not a usable checkpoint; the message names the file or tensors at fault."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A located checkpoint: its folder, parsed config.json, and tensor name -> shard file."""

    path: Path
    raw_config: dict[str, Any]
    tensors: dict[str, Path]

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a folder; expected a Hugging Face model folder")
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise CheckpointError(
                f"{folder} is not a checkpoint: config.json is missing "
                "(expected config.json, *.safetensors and tokenizer.json)"
            )
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
        return cls(folder, raw, _tensor_files(folder))


@contextmanager
def open_shard(path: Path) -> Iterator[Any]:
    """``safe_open(path)``; a truncated or corrupt file (while opening or reading a tensor) is a
    CheckpointError naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def _tensor_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise CheckpointError(f"{index.name} names shard files that are missing: {', '.join(missing)}")
        return {name: folder / file for name, file in weight_map.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder} is not a checkpoint: no *.safetensors files")
    tensors: dict[str, Path] = {}
    for shard in shards:
        with open_shard(shard) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                tensors[name] = shard
    return tensors


@dataclass(slots=True)
class LoadStats:
    """What ``load_model`` read: checkpoint weight tensors read (whole or sliced) and skipped (not held
    by this rank; a block scale counts with its weight), and the bytes read from the safetensors files
    as stored (values and scales)."""

    tensors_read: int = 0
    tensors_skipped: int = 0
    bytes_read: int = 0


def mtp_layers_present(config: ModelConfig, names: set[str]) -> int:
    """How many of the config's MTP layers the checkpoint actually contains tensors for."""
    present = 0
    for j in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{config.num_hidden_layers + j}."
        if any(n.startswith(prefix) for n in names):
            present += 1
    return present


# safetensors dtype names -> what error messages call them
_ST_DTYPES = {
    "F8_E4M3": "float8_e4m3fn", "I8": "int8", "U8": "uint8", "F8_E8M0": "float8_e8m0fnu", "F32": "float32",
    "BF16": "bfloat16", "F16": "float16",
}  # fmt: skip
_VALUE_DTYPES = {"fp8": ("F8_E4M3",), "mxfp4": ("I8", "U8")}
_SCALE_DTYPES = {"fp8": ("F32", "BF16", "F16", "F8_E8M0"), "mxfp4": ("U8", "F8_E8M0")}
_QUANT_PARAM_DTYPES = (FP8_DTYPE, torch.uint8)
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj")


def tensor_headers(ckpt: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of every tensor, from the shard headers (no data read)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(set(ckpt.tensors.values())):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                out[name] = (entry["dtype"], tuple(entry["shape"]))
    return out


def stored_format(config: ModelConfig, name: str) -> WeightFormat | None:
    """The format quantization_config gives the checkpoint weight ``name`` (experts may differ)."""
    return config.expert_weight_format if is_routed_expert_weight(name) else config.weight_format


def quantised_weights(
    config: ModelConfig, names: set[str], headers: dict[str, tuple[str, tuple[int, ...]]]
) -> frozenset[str]:
    """The checkpoint weights stored quantised (with a ``*_scale_inv``), each checked against its
    format: value dtype, scale dtype and the scale grid's shape. A low-precision weight without its
    scale, or a scale when config.json declares no quantisation, is a CheckpointError."""
    quantised = set()
    for name in sorted(names):
        if name.endswith(SCALE_SUFFIX) or IGNORED.match(name) or name not in headers:
            continue
        dtype, shape = headers[name]
        scale_name = name + SCALE_SUFFIX
        if scale_name not in names:
            if dtype == "F8_E4M3" or (dtype in ("I8", "U8") and is_routed_expert_weight(name)):
                raise CheckpointError(f"{name} is {_ST_DTYPES[dtype]} but {scale_name} is missing")
            continue
        fmt = stored_format(config, name)
        if fmt is None:
            raise CheckpointError(
                f"{name} has a block scale ({scale_name}) but config.json has no quantization_config"
            )
        what = "routed experts" if is_routed_expert_weight(name) else "weights"
        if dtype not in _VALUE_DTYPES[fmt.kind]:
            raise CheckpointError(
                f"{name} is {_ST_DTYPES.get(dtype, dtype)}, but quantization_config stores {what} as "
                f"{fmt.name} ({' or '.join(_ST_DTYPES[d] for d in _VALUE_DTYPES[fmt.kind])})"
            )
        scale_dtype, scale_shape = headers[scale_name]
        if scale_dtype not in _SCALE_DTYPES[fmt.kind]:
            raise CheckpointError(
                f"{scale_name} is {_ST_DTYPES.get(scale_dtype, scale_dtype)}; {fmt.name} scales are "
                f"{' or '.join(_ST_DTYPES[d] for d in _SCALE_DTYPES[fmt.kind])}"
            )
        if len(shape) < 2:
            raise CheckpointError(f"{name} has shape {shape}; a quantised weight is [..., N, K]")
        rows, cols = shape[-2], shape[-1] * (2 if fmt.kind == "mxfp4" else 1)
        expected = (*shape[:-2], *fmt.scale_shape(rows, cols))
        if tuple(scale_shape) != expected:
            raise CheckpointError(
                f"{scale_name} has shape {tuple(scale_shape)}, expected {expected} for the {rows}x{cols} "
                f"weight {name} in {fmt.block[0]}x{fmt.block[1]} blocks ({fmt.name})"
            )
        quantised.add(name)
    return frozenset(quantised)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shard: ExpertShard | None = None,
    weights: str = "as-stored",
) -> tuple[DeepseekV3ForCausalLM, Checkpoint]:
    """Build the model described by ``path/config.json`` and fill it from the safetensors; with
    ``shard``, only this rank's experts (see the module docstring). ``weights``: "as-stored" keeps
    quantised weights where the active op backend has kernels for them, "bf16" / "fp32" dequantises
    them into that dtype (which must be ``dtype``); ``model.weight_plan.describe()`` says which."""
    from deepinfer.backends.registry import active_ops
    from deepinfer.platform.registry import current_platform

    ckpt = Checkpoint.open(path)
    config = ModelConfig.from_dict(ckpt.raw_config)
    names = set(ckpt.tensors)
    present = mtp_layers_present(config, names)
    if present < config.num_nextn_predict_layers:
        if present:
            raise CheckpointError(
                f"config.json declares num_nextn_predict_layers={config.num_nextn_predict_layers} but the "
                f"checkpoint holds only {present} MTP layer(s)"
            )
        logger.info(
            "checkpoint has no MTP weights (config declares %d layer(s)); loading without MTP",
            config.num_nextn_predict_layers,
        )
        config = config.model_copy(update={"num_nextn_predict_layers": 0})
    quantised = quantised_weights(config, names, tensor_headers(ckpt))
    fp8_math = current_platform().chip.fp8_tflops is not None
    plan = plan_weights(
        config.weight_format, config.expert_weight_format, quantised, weights, dtype, active_ops(), fp8_math
    )
    fused = frozenset(int(m.group(1)) for n in names if (m := _FUSED_EXPERTS.fullmatch(n)))
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config, dtype, device, shard, plan, fused)
    params = dict(model.named_parameters())
    covered: dict[str, torch.Tensor] = {}  # byte parameters (no NaN): rows written, on the host
    for name, p in params.items():
        if p.dtype.is_floating_point:
            p.data.fill_(float("nan"))
        else:
            covered[name] = torch.zeros(p.shape[:-1], dtype=torch.bool)

    plan_targets: dict[str, list[Target]] = {}
    stats = LoadStats()
    unexpected = []
    for name in sorted(names):
        if IGNORED.match(name):
            continue
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in names:
                unexpected.append(name)
            continue  # planned with its weight
        targets = model.checkpoint_targets(name)
        if targets is None or any(t.param not in params for t in targets):
            unexpected.append(name)
            continue
        if not targets:
            stats.tensors_skipped += 1  # an expert another rank holds
            continue
        plan_targets[name] = targets
        kept = params[targets[0].param].dtype in _QUANT_PARAM_DTYPES
        if kept and name not in quantised:
            raise CheckpointError(
                f"{name} is not quantised (no {name + SCALE_SUFFIX}), but the other weights it is stored "
                "with are: a merged or stacked parameter holds one format"
            )
        if kept:
            scale_targets = model.checkpoint_targets(name + SCALE_SUFFIX)
            if not scale_targets or any(t.param not in params for t in scale_targets):
                raise CheckpointError(f"{name + SCALE_SUFFIX}: the model has no scale parameter for it")
            plan_targets[name + SCALE_SUFFIX] = scale_targets
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors this model does not use: {_names(unexpected)}")

    by_shard: dict[Path, list[str]] = {}
    for name in plan_targets:
        by_shard.setdefault(ckpt.tensors[name], []).append(name)
    for file in tqdm(sorted(by_shard), desc="Loading safetensors shards", unit="shard", disable=None):
        with open_shard(file) as f:
            for name in by_shard[file]:
                stats.tensors_read += not name.endswith(SCALE_SUFFIX)  # a scale is counted with its weight
                targets = plan_targets[name]
                sliced = f.get_slice(name) if all(t.source for t in targets) else None
                whole = None
                for target in targets:
                    param = params[target.param]
                    if sliced is not None:
                        part = sliced[target.source]
                        stats.bytes_read += part.numel() * part.element_size()
                        tensor = _prepare(ckpt, name, part, target, param, config, quantised, stats)
                    elif whole is None:  # read (and dequantised) once for all its targets
                        part = f.get_tensor(name)
                        stats.bytes_read += part.numel() * part.element_size()
                        tensor = whole = _prepare(ckpt, name, part, target, param, config, quantised, stats)
                    else:
                        tensor = whole
                    _assign(param, target, tensor, name)
                    if target.param in covered:
                        cover = covered[target.param]
                        (cover[target.index] if target.index else cover).fill_(True)

    missing = [n for n, p in params.items() if n not in covered and torch.isnan(p.data).any()]
    missing += [n for n, rows in covered.items() if not bool(rows.all())]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors for: {_names([_hint(m) for m in missing])}")
    model.finish_loading()
    model.eval()
    model.load_stats = stats
    logger.info("%s", plan.describe())
    return model, ckpt


def _prepare(
    ckpt: Checkpoint,
    name: str,
    part: torch.Tensor,
    target: Target,
    param: torch.nn.Parameter,
    config: ModelConfig,
    quantised: frozenset[str],
    stats: LoadStats,
) -> torch.Tensor:
    """A checkpoint tensor (or slice) as the parameter holds it: a kept scale as float32 (fp8) or
    e8m0 bytes (mxfp4), kept MXFP4 values as uint8, a quantised weight held in high precision
    dequantised (its scale read here, the same slice), anything else as stored."""
    if name.endswith(SCALE_SUFFIX):
        fmt = stored_format(config, name.removesuffix(SCALE_SUFFIX))
        assert fmt is not None
        return _scale_as_held(part, fmt)
    if name not in quantised:
        return part
    fmt = stored_format(config, name)
    assert fmt is not None
    if fmt.kind == "mxfp4":
        part = part.view(torch.uint8)
    if param.dtype in _QUANT_PARAM_DTYPES:
        return part
    scale_name = name + SCALE_SUFFIX
    with open_shard(ckpt.tensors[scale_name]) as f:
        scale = f.get_slice(scale_name)[target.source] if target.source else f.get_tensor(scale_name)
    stats.bytes_read += scale.numel() * scale.element_size()
    try:
        return dequantize(part, _scale_as_held(scale, fmt), fmt)
    except ValueError as exc:
        raise CheckpointError(f"{name}: {exc}") from None


def _scale_as_held(scale: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """A stored scale -> float32 (fp8 formats; e8m0 and 16-bit scales convert exactly) or the uint8
    e8m0 exponent bytes (mxfp4)."""
    if fmt.kind == "mxfp4":
        return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return scale.float()


def _assign(param: torch.nn.Parameter, target: Target, tensor: torch.Tensor, name: str) -> None:
    dest = param.data[target.index] if target.index else param.data
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{name} has shape {tuple(tensor.shape)}, but the model expects {tuple(dest.shape)} "
            "(does config.json match the weights?)"
        )
    if dest.dtype != tensor.dtype and (
        dest.dtype in _QUANT_PARAM_DTYPES or tensor.dtype in _QUANT_PARAM_DTYPES
    ):
        raise CheckpointError(f"{name} is {tensor.dtype}, but the model holds it as {dest.dtype}")
    dest.copy_(tensor)


def _hint(param: str) -> str:
    """The checkpoint name a model parameter is loaded from, for error messages."""
    name = re.sub(r"^mtp_layers\.(\d+)\.block\.", r"model.layers.<N+\1>.", param)
    name = re.sub(r"^mtp_layers\.(\d+)\.", r"model.layers.<N+\1>.", name)
    name = re.sub(r"^(layers\.|embed_tokens$|norm\.)", r"model.\1", name)
    name = name.replace("mlp.experts.w13_scale", "mlp.experts.{e}.gate_proj/up_proj.weight_scale_inv")
    name = name.replace("mlp.experts.w2_scale", "mlp.experts.{e}.down_proj.weight_scale_inv")
    name = name.replace("mlp.experts.w13", "mlp.experts.{e}.gate_proj/up_proj.weight")
    name = name.replace("mlp.experts.w2", "mlp.experts.{e}.down_proj.weight")
    name = name.replace("gate_up_proj.weight", "gate_proj/up_proj.weight")
    name = re.sub(r"\.weight_scale$", ".weight_scale_inv", name)
    return name.replace("model.embed_tokens", "model.embed_tokens.weight")


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")
