"""Load a standard Hugging Face checkpoint folder into ``DeepseekV3ForCausalLM``.

Reads ``config.json``, single or sharded ``*.safetensors`` (with ``model.safetensors.index.json``),
in DeepSeek's published per-expert layout or transformers 5's fused-expert layout, and DeepSeek's FP8
e4m3 weights with block scales (``weight_scale_inv``), which are dequantised into the model dtype.
Every parameter is poisoned with NaN before loading, so any part the checkpoint did not provide is
reported by name; unknown and mis-shaped tensors are reported by name too.

Under expert parallelism (an ``ExpertShard``) a rank reads only the tensors it needs: expert tensors
of experts it does not hold are never opened (so their FP8 weights are never dequantised), and fused
expert tensors are read as slices of the experts it holds. ``model.load_stats`` says what was read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer.logger import get_logger
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM, Target
from deepinfer.model.fp8 import FP8_DTYPE, dequantize_block_fp8

if TYPE_CHECKING:
    from deepinfer.parallel.placement import ExpertShard

logger = get_logger(__name__)

SCALE_SUFFIX = "weight_scale_inv"
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
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                tensors[name] = shard
    return tensors


@dataclass(slots=True)
class LoadStats:
    """What ``load_model`` read: checkpoint tensors read (whole or sliced) and skipped (not held by
    this rank), and the weight bytes read from the safetensors files (as stored; FP8 scales not counted)."""

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


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shard: ExpertShard | None = None,
) -> tuple[DeepseekV3ForCausalLM, Checkpoint]:
    """Build the model described by ``path/config.json`` and fill it from the safetensors; with
    ``shard``, only this rank's experts (see the module docstring)."""
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
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config, dtype, device, shard)
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.fill_(float("nan"))

    plan: dict[str, list[Target]] = {}
    stats = LoadStats()
    unexpected = []
    for name in sorted(names):
        if name.endswith(SCALE_SUFFIX) or IGNORED.match(name):
            continue
        targets = model.checkpoint_targets(name)
        if targets is None or any(t.param not in params for t in targets):
            unexpected.append(name)
        elif targets:
            plan[name] = targets
        else:
            stats.tensors_skipped += 1  # an expert another rank holds
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors this model does not use: {_names(unexpected)}")

    by_shard: dict[Path, list[str]] = {}
    for name in plan:
        by_shard.setdefault(ckpt.tensors[name], []).append(name)
    for file in tqdm(sorted(by_shard), desc="Loading safetensors shards", unit="shard", disable=None):
        with safe_open(file, framework="pt") as f:
            for name in by_shard[file]:
                stats.tensors_read += 1
                if all(t.source for t in plan[name]):
                    sliced = f.get_slice(name)
                    for target in plan[name]:
                        part = sliced[target.source]
                        if part.dtype == FP8_DTYPE:
                            raise CheckpointError(f"{name}: FP8 fused expert tensors are not supported")
                        stats.bytes_read += part.numel() * part.element_size()
                        _assign(params[target.param], target, part, name)
                    continue
                tensor = f.get_tensor(name)
                stats.bytes_read += tensor.numel() * tensor.element_size()
                if tensor.dtype == FP8_DTYPE:
                    tensor = _dequantize(ckpt, name, tensor, config)
                for target in plan[name]:
                    _assign(params[target.param], target, tensor, name)

    missing = [n for n, p in params.items() if torch.isnan(p.data).any()]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors for: {_names([_hint(m) for m in missing])}")
    model.finish_loading()
    model.eval()
    model.load_stats = stats
    return model, ckpt


def _dequantize(ckpt: Checkpoint, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    scale_name = name.removesuffix("weight") + SCALE_SUFFIX
    shard = ckpt.tensors.get(scale_name)
    if shard is None:
        raise CheckpointError(f"{name} is float8_e4m3fn but {scale_name} is missing")
    with safe_open(shard, framework="pt") as f:
        scale_inv = f.get_tensor(scale_name)
    try:
        return dequantize_block_fp8(tensor, scale_inv, config.fp8_block_size or (128, 128))
    except ValueError as exc:
        raise CheckpointError(f"{name}: {exc}") from None


def _assign(param: torch.nn.Parameter, target: Target, tensor: torch.Tensor, name: str) -> None:
    dest = param.data[target.index] if target.index else param.data
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{name} has shape {tuple(tensor.shape)}, but the model expects {tuple(dest.shape)} "
            "(does config.json match the weights?)"
        )
    dest.copy_(tensor)


def _hint(param: str) -> str:
    """The checkpoint name a model parameter is loaded from, for error messages."""
    name = re.sub(r"^mtp_layers\.(\d+)\.block\.", r"model.layers.<N+\1>.", param)
    name = re.sub(r"^mtp_layers\.(\d+)\.", r"model.layers.<N+\1>.", name)
    name = re.sub(r"^(layers\.|embed_tokens$|norm\.)", r"model.\1", name)
    name = name.replace("mlp.experts.w13", "mlp.experts.{e}.gate_proj/up_proj.weight")
    name = name.replace("mlp.experts.w2", "mlp.experts.{e}.down_proj.weight")
    name = name.replace("gate_up_proj.weight", "gate_proj/up_proj.weight")
    return name.replace("model.embed_tokens", "model.embed_tokens.weight")


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")
