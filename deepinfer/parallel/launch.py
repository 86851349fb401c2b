"""Offline generation over data-parallel ranks on one or several hosts, one process per rank, launched
by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST0 --master-port 29500 \\
        -m deepinfer.parallel.launch --model PATH --file prompts.txt --max-tokens 256 --out out.jsonl

(and ``--node-rank 1`` on the second host). Every rank reads the prompt file, keeps the prompts with
``index % world == rank`` (requests are spread evenly; they all arrive at once, so the fewest-active
rule is round robin), runs the lockstep until no rank has work, and the outputs are gathered on rank 0,
which writes them in prompt order as JSON lines (``--out``, or stdout). A rank that fails makes the
others fail within ``--dp-timeout-s``; torchrun then stops the job and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from deepinfer.model_zoo import model_argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deepinfer.parallel.launch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", type=model_argument, help="model folder or bundled model name (default: the bundled model)"
    )
    parser.add_argument("--file", required=True, help="prompts, one per line")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-expert-parallel", action="store_true", help="replicate the experts instead")
    parser.add_argument("--redundant-experts", type=int, default=0)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--dp-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", help="write JSON lines here (rank 0); default stdout")
    return parser.parse_args(argv)


def _torchrun_env() -> tuple[int, int, int, int, str]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise SystemExit(f"deepinfer.parallel.launch runs under torchrun; {', '.join(missing)} not set")
    rank, world, local, local_world = (int(os.environ[n]) for n in names[:4])
    return rank, world, local, local_world, os.environ["MASTER_ADDR"]


def pin_local_device(local_rank: int) -> None:
    """Make this process see only its own device: every registered platform's visible-devices variable
    is narrowed to entry ``local_rank`` (of the list already set, or of 0..n). Done before any platform
    is detected, so the device runtime starts with it; a CPU host has no such variable and is unaffected."""
    from deepinfer.platform.registry import load_platform_class, registered_platforms

    for qualname in registered_platforms().values():
        name = load_platform_class(qualname).visible_devices_env
        if name:
            current = os.environ.get(name)
            entries = current.split(",") if current else [str(i) for i in range(local_rank + 1)]
            if local_rank >= len(entries):
                raise SystemExit(f"{name}={current} lists no device for local rank {local_rank}")
            os.environ[name] = entries[local_rank]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, local_rank, local_world, master = _torchrun_env()

    pin_local_device(local_rank)

    import torch.distributed as dist

    from deepinfer.config import EngineConfig
    from deepinfer.model_zoo import default_model_path
    from deepinfer.parallel.rank import DataParallelRank, init_group
    from deepinfer.sampling_params import SamplingParams

    nnodes = world // local_world
    options = dict(
        model=str(args.model or default_model_path()),
        data_parallel_size=world,
        enable_expert_parallel=not args.no_expert_parallel,
        num_redundant_experts=args.redundant_experts,
        dp_timeout_s=args.dp_timeout_s,
        nnodes=nnodes,
        node_rank=rank // local_world,
        master_addr=master if nnodes > 1 else None,
    )
    if args.num_kv_blocks:
        options["num_kv_blocks"] = args.num_kv_blocks
    config = EngineConfig(**options)
    with open(args.file, encoding="utf-8") as f:
        prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    init_group(config, rank, "env://")
    dp_rank = DataParallelRank(config, rank)
    try:
        params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
        for i in range(rank, len(prompts), world):
            dp_rank.add_request(f"p{i}", prompts[i], None, params)
        finished = {}
        while True:
            step = dp_rank.step()
            for out in step.outputs:
                if out.finished:
                    finished[int(out.request_id[1:])] = out
            if step.tokens == 0 and not step.any_work:
                break
        gathered: list = [None] * world if rank == 0 else []
        rows = [
            {"index": i, "prompt": o.prompt, "text": o.text, "token_ids": o.token_ids, "rank": rank}
            for i, o in finished.items()
        ]
        dist.gather_object(rows, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            ordered = sorted((row for part in gathered for row in part), key=lambda r: r["index"])
            lines = "".join(json.dumps(r) + "\n" for r in ordered)
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    f.write(lines)
            else:
                sys.stdout.write(lines)
    finally:
        dp_rank.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
