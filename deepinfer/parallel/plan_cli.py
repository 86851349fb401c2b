"""``deepinfer plan memory``: per-rank weight, KV and activation memory of a model config at several
expert-parallel sizes, against each chip's HBM (argparse only here; the plan itself is imported when
the command runs, so ``deepinfer --help`` stays light)."""

from __future__ import annotations

import argparse
import json


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    from deepinfer.model_zoo import model_argument

    parser.add_argument(
        "--model", required=True, type=model_argument,
        help="config.json, a model folder holding one, or a bundled model's name",
    )  # fmt: skip
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64], help="expert-parallel sizes")
    parser.add_argument(
        "--weights", choices=["as-stored", "fp8", "bf16", "fp32"], default="as-stored",
        help="weights held as the checkpoint stores them (FP8 / MXFP4 values plus scales), as DeepSeek's "
        "FP8 (128x128 blocks), or dequantised to bf16 / fp32",
    )  # fmt: skip
    parser.add_argument("--redundant-experts", type=int, default=0, help="extra expert slots per layer")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens of one step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sampled rows of one step")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_memory(args: argparse.Namespace) -> int:
    """Print the memory plans. Bad input raises ValueError naming the flag or file (``deepinfer.cli``
    prints it as one line and exits 2)."""
    from deepinfer.parallel.memory_plan import format_plans, load_config, plan_memory, plans_as_json

    for flag, value, least in (
        ("--redundant-experts", args.redundant_experts, 0),
        ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
        ("--max-num-seqs", args.max_num_seqs, 1),
        *(("--ep", ep, 1) for ep in args.ep),
    ):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    try:
        config = load_config(args.model)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {args.model}: config.json is not valid JSON ({exc})") from None
    except ValueError as exc:  # no config.json, or a model type the plan does not know
        message = str(exc)
        raise ValueError(
            message if message.startswith("--model") else f"--model {args.model}: {message}"
        ) from None
    except (TypeError, AttributeError, KeyError) as exc:  # JSON that is not a config object
        raise ValueError(
            f"--model {args.model}: config.json must hold a JSON object of model settings ({type(exc).__name__}: {exc})"
        ) from None
    plans = []
    for ep in args.ep:
        try:
            plans.append(
                plan_memory(
                    config,
                    ep,
                    args.weights,
                    args.redundant_experts,
                    args.max_num_batched_tokens,
                    args.max_num_seqs,
                )
            )
        except ValueError as exc:
            raise ValueError(f"--ep {ep}: {exc}") from None
    print(plans_as_json(plans) if args.json else format_plans(plans))
    return 0
