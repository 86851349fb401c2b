"""``deepinfer serve`` options for data and expert parallelism (argparse only: no heavy imports)."""

from __future__ import annotations

import argparse
import socket


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores in one torch.distributed group (ranks)",
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="shard the routed experts over the ranks"
    )
    parser.add_argument("--num-redundant-experts", type=int, help="extra expert slots per MoE layer (EPLB)")
    parser.add_argument("--eplb-interval", type=int, help="rearrange experts every this many steps (EPLB)")
    parser.add_argument("--dp-timeout-s", type=float, help="a collective waiting longer fails (dead rank)")


def parallel_options(args: argparse.Namespace) -> dict:
    """EngineConfig options from the parsed arguments; with several ranks, a free loopback port for
    their rendezvous."""
    options = {
        "data_parallel_size": args.data_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel or None,
        "num_redundant_experts": args.num_redundant_experts,
        "eplb_interval": args.eplb_interval,
        "dp_timeout_s": args.dp_timeout_s,
    }
    if args.data_parallel_size > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            options["master_port"] = s.getsockname()[1]
    return {k: v for k, v in options.items() if v is not None}
