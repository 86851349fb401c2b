"""Write an FP8 block-quantised copy of a DeepSeek-family checkpoint, in DeepSeek's own checkpoint format.

    .venv/bin/python tools/quantize_fp8.py --src deepinfer/models/deepinfer-tiny-coder \\
        --out deepinfer/models/deepinfer-tiny-coder-fp8 [--block 128 128] [--scale-fmt f32|ue8m0] \\
        [--keep-dtype bfloat16|float32] [--quality bench/results/quality_fp8.json]

What is quantised follows DeepSeek's published V3/R1 checkpoints (``model.safetensors.index.json``:
which names have a ``weight_scale_inv`` companion): every linear weight of the attention
(``q_proj``/``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), of the dense
MLPs, of the shared experts and of every routed expert, in the main layers and in the MTP layer's
decoder block. Those become ``weight`` float8_e4m3fn [N, K] plus ``weight_scale_inv`` float32
[ceil(N/bn), ceil(K/bk)] (per-block absmax scaled to +-448, ``deepinfer.backends.quant.quantize_weight``;
with ``--scale-fmt ue8m0`` each scale is rounded up to a power of two, as V3.1+ ships them). Everything
else stays in high precision, in ``--keep-dtype`` (default bfloat16, as DeepSeek ships them): the
embeddings, ``lm_head``, every norm, the router ``mlp.gate.weight``, the MTP layer's ``eh_proj``, its
``embed_tokens`` and ``shared_head``; ``e_score_correction_bias`` stays float32 (as DeepSeek ships it).

The output folder gets ``config.json`` with ``quantization_config`` ``{"quant_method": "fp8", "fmt":
"e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}`` (plus ``"scale_fmt": "ue8m0"``
when chosen) and ``dtype`` set to ``--keep-dtype``; one ``model.safetensors`` in DeepSeek's per-expert
layout (a fused transformers-5 source is split per expert); copies of the tokenizer, generation config
and the ``confidence_head/`` folder (the MTP drafter's gate, trained on the source model: see the
README it writes); ``quantization.json`` (what was quantised, the byte counts, the worst relative
error per tensor); and a ``README.md`` saying how it was made, with the quality figures of
``--quality`` (the JSON ``bench/quality.py --reference`` writes) when given. The output is a function
of the source and the options: the same command writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.backends.quant import WeightFormat, dequantize, quantize_weight
from deepinfer.model.layouts import to_published_layout

SCALE_SUFFIX = "weight_scale_inv"
# Linear weights DeepSeek ships in FP8 (each has a weight_scale_inv in its index): attention
# projections, dense MLPs, shared experts and routed experts, wherever the layer is (main or MTP).
QUANTISED = re.compile(
    r"model\.layers\.\d+\."
    r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight"
)
KEPT_FLOAT32 = re.compile(r".*\.e_score_correction_bias")  # DeepSeek ships the routing bias in float32
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
COPIED_FOLDERS = ("confidence_head",)
KEEP_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Widths along which engines split or merge weights (gate/up into one matrix, per-expert stacks).
WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size")


def is_quantised(name: str) -> bool:
    """Whether DeepSeek's checkpoints store tensor ``name`` (published per-expert layout) in FP8."""
    return QUANTISED.fullmatch(name) is not None


def read_checkpoint(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of a single or sharded safetensors folder (published layout)."""
    config_file = src / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--src {src}: no config.json there (expected a Hugging Face model folder)")
    config = json.loads(config_file.read_text())
    if config.get("quantization_config"):
        raise ValueError(
            f"--src {src}: already quantised ({config['quantization_config']}); give a high-precision checkpoint"
        )
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"--src {src}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    return config, to_published_layout(tensors)


def quantise_tensors(
    tensors: dict[str, torch.Tensor], fmt: WeightFormat, keep_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The output tensors (FP8 pairs and kept tensors, sorted by name) and one report row per source
    tensor: its name, shape, how it is stored, its stored bytes, and for FP8 the largest error
    relative to the tensor's absolute maximum (at most 16/448 = 0.0357 with float32 scales: half an
    e4m3 step at the top of the range, where each block's maximum lands; up to twice that with ue8m0
    scales, which round each block's scale up to a power of two)."""
    out: dict[str, torch.Tensor] = {}
    rows = []
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            raise ValueError(
                f"{name}: dtype {t.dtype} is not a floating-point weight; nothing else is expected"
            )
        row: dict[str, Any] = {"name": name, "shape": list(t.shape)}
        if is_quantised(name):
            if t.dim() != 2:
                raise ValueError(f"{name}: a linear weight must be 2-D [N, K], got shape {tuple(t.shape)}")
            values, scale = quantize_weight(t, fmt)
            err = (dequantize(values, scale, fmt) - t.float()).abs().max().item()
            out[name], out[name.removesuffix("weight") + SCALE_SUFFIX] = values, scale.contiguous()
            row.update(
                stored="float8_e4m3fn",
                bytes=values.numel() + scale.numel() * 4,
                max_abs_error_over_absmax=err / max(t.abs().max().item(), 1e-30),
            )
        else:
            dtype = torch.float32 if KEPT_FLOAT32.fullmatch(name) else keep_dtype
            out[name] = t.to(dtype).contiguous()
            row.update(stored=str(dtype).removeprefix("torch."), bytes=t.numel() * out[name].element_size())
        rows.append(row)
    return out, rows


def quantisation_config(fmt: WeightFormat) -> dict[str, Any]:
    """The ``config.json`` ``quantization_config`` DeepSeek's FP8 checkpoints carry for ``fmt``."""
    quant: dict[str, Any] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(fmt.block),
    }
    if fmt.scale_fmt == "ue8m0":
        quant["scale_fmt"] = "ue8m0"
    return quant


def write_model(
    src: Path,
    out: Path,
    block: tuple[int, int],
    scale_fmt: str,
    keep_dtype: str,
    quality: Path | None,
    command: str,
) -> dict[str, Any]:
    """Write the quantised folder ``out`` from ``src`` (see the module docstring); returns its report."""
    if keep_dtype not in KEEP_DTYPES:
        raise ValueError(f"--keep-dtype must be one of {', '.join(KEEP_DTYPES)}, got {keep_dtype!r}")
    fmt = WeightFormat("fp8", block, scale_fmt)  # validates the block and scale format
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out} is the source folder; write the copy elsewhere")
    config, tensors = read_checkpoint(src)
    quantised, rows = quantise_tensors(tensors, fmt, KEEP_DTYPES[keep_dtype])
    out.mkdir(parents=True, exist_ok=True)
    save_file(quantised, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it private; the source model's is 0644
    config = {**config, "quantization_config": quantisation_config(fmt), "dtype": keep_dtype}
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    for name in COPIED_FOLDERS:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name, dirs_exist_ok=True)
    fp8 = [r for r in rows if r["stored"] == "float8_e4m3fn"]
    report = {
        "source": src.name,
        "format": {"block": list(block), "scale_fmt": scale_fmt, "kept_dtype": keep_dtype},
        "quantised_tensors": len(fp8),
        "kept_tensors": len(rows) - len(fp8),
        "quantised_params": sum(_numel(r) for r in fp8),
        "kept_params": sum(_numel(r) for r in rows if r not in fp8),
        "stored_bytes": {
            "fp8_values_and_scales": sum(r["bytes"] for r in fp8),
            "kept": sum(r["bytes"] for r in rows if r not in fp8),
            "source_file": sum(p.stat().st_size for p in src.glob("*.safetensors")),
            "model_safetensors": (out / "model.safetensors").stat().st_size,
        },
        "max_abs_error_over_absmax": max((r["max_abs_error_over_absmax"] for r in fp8), default=0.0),
        "widths": {k: config[k] for k in WIDTHS if config.get(k)},
        "tensors": rows,
    }
    (out / "quantization.json").write_text(_report_json(report))
    quality_figures = json.loads(quality.read_text()) if quality else None
    (out / "README.md").write_text(readme(out.name, report, command, quality_figures))
    return report


def _report_json(report: dict[str, Any]) -> str:
    """The report as JSON, one line per tensor (diffable, a few kB per hundred tensors)."""
    head = json.dumps({k: v for k, v in report.items() if k != "tensors"}, indent=2)
    rows = ",\n".join("    " + json.dumps(row) for row in report["tensors"])
    return head[:-2] + ',\n  "tensors": [\n' + rows + "\n  ]\n}\n"


def _numel(row: dict[str, Any]) -> int:
    n = 1
    for d in row["shape"]:
        n *= d
    return n


def readme(name: str, report: dict[str, Any], command: str, quality: dict[str, Any] | None) -> str:
    """The model card: provenance, what is stored how, sizes, and the measured quality (if given)."""
    fmt = report["format"]
    b = report["stored_bytes"]
    kinds = [_kept_kind(r["name"]) for r in report["tensors"] if r["stored"] != "float8_e4m3fn"]
    kept = sorted(
        set(kinds),
        key=lambda kind: (kind not in KEPT_KINDS, KEPT_KINDS.index(kind) if kind in KEPT_KINDS else 0, kind),
    )
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: deepinfer",
        "pipeline_tag: text-generation",
        "tags:",
        "  - deepseek_v3",
        "  - fp8",
        "  - tiny",
        "  - test-model",
        "---",
        "",
        f"# {name}",
        "",
        f"`{report['source']}` with its linear and expert weights block-quantised to FP8, in DeepSeek's own",
        "checkpoint format (float8_e4m3fn `weight` plus a float32 `weight_scale_inv` per "
        f"{fmt['block'][0]}x{fmt['block'][1]} block{', each a power of two (`scale_fmt` ue8m0)' if fmt['scale_fmt'] == 'ue8m0' else ''},",
        "`quantization_config` as DeepSeek's). It exists so that engines can be tested and measured on",
        "real trained weights as DeepSeek ships them. Select it with `--model deepinfer-tiny-coder-fp8`",
        '(`LLM(model="deepinfer-tiny-coder-fp8")`).',
        "",
        "## How it was made",
        "",
        "```",
        command,
        "```",
        "",
        "`tools/quantize_fp8.py` (deepinfer repository): per-block absmax scaling to +-448 "
        f"(scales {fmt['scale_fmt']}), round to",
        "nearest e4m3. The same command writes the same bytes. `quantization.json` lists every tensor with",
        "its storage and the largest quantisation error relative to the tensor's absolute maximum "
        f"(worst: {report['max_abs_error_over_absmax']:.4f}).",
        "",
        "| stored as | tensors | parameters | bytes |",
        "|---|---|---|---|",
        f"| FP8 e4m3 + float32 block scales | {report['quantised_tensors']} | {report['quantised_params']:,} | "
        f"{b['fp8_values_and_scales']:,} |",
        f"| {fmt['kept_dtype']} (routing bias float32) | {report['kept_tensors']} | {report['kept_params']:,} | "
        f"{b['kept']:,} |",
        "",
        f"`model.safetensors`: {b['model_safetensors']:,} bytes (the float32 source: {b['source_file']:,}).",
        "",
        "FP8 (as DeepSeek's checkpoints): the attention projections (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj,",
        "o_proj), the dense MLP, the shared and routed experts, in every main layer and in the MTP",
        "layer's decoder block. Kept in high precision: " + ", ".join(kept) + ".",
        *_block_note(fmt["block"], report["widths"]),
        "",
        "`confidence_head/` is a copy of the source model's (the MTP drafter's acceptance gate, trained on",
        "the float32 model's drafts): it runs unchanged on this model, but its threshold was not re-tuned.",
        "",
        "## Quality",
        "",
    ]
    lines += _quality_lines(quality)
    lines += [
        "",
        "## Licence",
        "",
        "Apache-2.0, as the source model (its training data: the Python standard library, PSF-2.0).",
        "",
    ]
    return "\n".join(lines)


def _block_note(block: list[int], widths: dict[str, int]) -> list[str]:
    """Why this block suits (or does not suit) the model: whether it divides the widths an engine
    splits or merges weights along (an expert's gate/up rows, the hidden size)."""
    shown = ", ".join(f"{k} {v}" for k, v in widths.items())
    unaligned = [k for k, v in widths.items() if v % block[0] or v % block[1]]
    if not unaligned:
        v3 = [k for k, v in widths.items() if v % 128]
        lines = [
            f"{block[0]}x{block[1]} divides every width engines split or merge weights along ({shown}):",
            "each expert's gate and up projections keep their own scale rows inside a merged w13, so an",
            "engine can hold every linear and expert weight in FP8.",
        ]
        if v3:
            lines += [
                f"DeepSeek-V3's 128x128 blocks would not divide {', '.join(v3)}: the gate and up halves would",
                "share blocks, and engines that merge them dequantise those weights (deepinfer does).",
                "DeepSeek-V4.1 ships its dense weights in 32x32 blocks with ue8m0 scales.",
            ]
        return lines
    return [
        f"{block[0]}x{block[1]} does not divide {', '.join(unaligned)} ({shown}): an engine that merges",
        "projections along those widths cannot share one scale grid, and may dequantise those weights.",
    ]


_KEPT_PATTERNS = (
    (r".*embed_tokens\.weight", "embeddings (main and MTP)"),
    (r"(lm_head|.*shared_head\.head)\.weight", "lm_head and the MTP shared head"),
    (r".*norm\.weight", "norms"),
    (r".*mlp\.gate\.weight", "the router gate"),
    (r".*e_score_correction_bias", "e_score_correction_bias"),
    (r".*eh_proj\.weight", "the MTP eh_proj"),
)
KEPT_KINDS = [kind for _, kind in _KEPT_PATTERNS]


def _kept_kind(name: str) -> str:
    """How the README names a kept tensor's kind (the tensor's name when it is of no known kind)."""
    return next((kind for pattern, kind in _KEPT_PATTERNS if re.fullmatch(pattern, name)), name)


def _quality_lines(quality: dict[str, Any] | None) -> list[str]:
    if quality is None:
        return ["Not measured for this build: `bench/quality.py --reference` measures it (see the tool)."]
    fp8, ref = quality["model"], quality["reference"]
    lines = [
        f"Perplexity on {quality['heldout_tokens']:,} held-out tokens ({quality['windows']} windows of "
        f"{quality['window_len']} tokens of the standard-library files the source model never trained on;",
        "`bench/quality.py`), both through deepinfer on the same tokens:",
        "",
        "| model | perplexity | next-token top-1 accuracy |",
        "|---|---|---|",
        f"| {Path(ref['model']).name} (float32) | {ref['perplexity']:.3f} | {ref['top1_accuracy']:.4f} |",
        f"| {Path(fp8['model']).name} | {fp8['perplexity']:.3f} | {fp8['top1_accuracy']:.4f} |",
        "",
        f"Perplexity ratio {quality['perplexity_ratio']:.5f} ({(quality['perplexity_ratio'] - 1) * 100:+.3f}%); "
        f"the two models' top-1 predictions agree on {quality['top1_agreement']:.4f} of positions; mean",
        f"|log p difference| of the actual token {quality['mean_abs_logprob_diff']:.4f} nats.",
        f"The engine held the FP8 model's weights as: {fp8['weights']['summary']} "
        f"({fp8['weights']['total_bytes']:,} bytes, {fp8['weights']['quantised_bytes']:,} of them FP8 values and "
        f"scales; the float32 model: {ref['weights']['total_bytes']:,}).",
        f"Measured at commit {quality['env']['git_commit']} on {quality['env']['cpu']}, op backend "
        f"`{quality['env']['op_backend']}` (`bench/results/quality_fp8.json`).",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, help="a high-precision Hugging Face model folder")
    parser.add_argument("--out", required=True, help="the folder to write (created)")
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"))
    parser.add_argument("--scale-fmt", choices=["f32", "ue8m0"], default="f32", help="block scales")
    parser.add_argument("--keep-dtype", choices=list(KEEP_DTYPES), default="bfloat16")
    parser.add_argument(
        "--quality", type=Path, help="bench/quality.py --reference JSON to quote in the README"
    )
    args = parser.parse_args(argv)
    argv_shown = argv if argv is not None else sys.argv[1:]
    command = " ".join([".venv/bin/python tools/quantize_fp8.py", *argv_shown])
    try:
        report = write_model(
            Path(args.src),
            Path(args.out),
            tuple(args.block),
            args.scale_fmt,
            args.keep_dtype,
            args.quality,
            command,
        )
    except ValueError as exc:
        print(f"quantize_fp8: {exc}", file=sys.stderr)
        return 2
    b = report["stored_bytes"]
    print(
        f"{args.out}: {report['quantised_tensors']} tensors FP8 ({b['fp8_values_and_scales']:,} bytes), "
        f"{report['kept_tensors']} kept ({b['kept']:,} bytes); model.safetensors {b['model_safetensors']:,} bytes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
