"""Processes the failure tests start (``python rank_scripts.py MODE ...``).

- ``front TIMEOUT``: an offline data-parallel front (2 ranks) generating long completions; prints the
  rank PIDs, then ``RUNNING`` once tokens flow, and exits non-zero when generation fails.
- ``collectives RANK WORLD PORT``: one gloo rank running the collective-sequence check with a trace
  that differs on the last rank; prints ``MISMATCH`` when the check raised.
"""

from __future__ import annotations

import sys
from datetime import timedelta


def front(timeout: float) -> None:
    from deepinfer import LLM, SamplingParams

    llm = LLM(data_parallel_size=2, enable_expert_parallel=True, dp_timeout_s=timeout, num_kv_blocks=128)
    engine = llm.engine
    print("PIDS", *[p.pid for p in engine.procs], flush=True)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(6):
        engine.add_request(engine.new_request_id(), None, [5 + i, 6, 7, 8], params)
    announced = False
    while engine.has_unfinished_requests():
        if engine.step() and not announced:
            print("RUNNING", flush=True)
            announced = True
    print("FINISHED", flush=True)  # not reached when a rank dies


def collectives(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from deepinfer.parallel.rank import CollectiveMismatchError, check_collective_sequence

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    try:
        same = ["ep_dispatch+combine:1", "ep_dispatch+combine:2"]
        check_collective_sequence(same, dist.group.WORLD, rank, 0)  # equal: passes
        trace = same[:1] if rank == world - 1 else same  # the last rank skipped a layer
        try:
            check_collective_sequence(trace, dist.group.WORLD, rank, 1)
        except CollectiveMismatchError as exc:
            print("MISMATCH", exc, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "front":
        front(float(sys.argv[2]))
    else:
        collectives(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
