"""``deepinfer plan memory``: per-rank weight, KV and activation memory of a model config at several
expert-parallel sizes, against each chip's HBM (argparse only here; the plan itself is imported when
the command runs, so ``deepinfer --help`` stays light)."""

from __future__ import annotations

import argparse


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="config.json, or a model folder holding one")
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64], help="expert-parallel sizes")
    parser.add_argument("--weights", choices=["fp8", "bf16"], default="fp8", help="weight format held")
    parser.add_argument("--redundant-experts", type=int, default=0, help="extra expert slots per layer")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens of one step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sampled rows of one step")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_memory(args: argparse.Namespace) -> int:
    from deepinfer.parallel.memory_plan import format_plans, load_config, plan_memory, plans_as_json

    config = load_config(args.model)
    plans = [
        plan_memory(
            config, ep, args.weights, args.redundant_experts, args.max_num_batched_tokens, args.max_num_seqs
        )
        for ep in args.ep
    ]
    print(plans_as_json(plans) if args.json else format_plans(plans))
    return 0
