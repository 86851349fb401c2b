"""Expert-parallel dispatch/combine of the reference backend over a real torch.distributed gloo group.

Each rank owns a contiguous half of the experts, dispatches its tokens, runs its local experts on what it
received and combines; the result must equal ``fused_moe`` over ALL experts in one process. The ranks run
as subprocesses of this file (``python test_ep_distributed.py RANK WORLD PORT``) under a deadline, so a
hung collective fails the test instead of blocking it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing import assert_close

from deepinfer.backends.reference.ep import ep_combine, ep_dispatch
from deepinfer.backends.reference.moe import fused_moe

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERTS, TOP_K, HIDDEN, INTER = 8, 3, 16, 12
DEADLINE_S = 120  # whole test, both ranks; a healthy run takes a few seconds
COLLECTIVE_TIMEOUT = timedelta(seconds=60)

# Scenario -> tokens per rank for each world size, and whether routing is restricted to rank 0's experts.
SCENARIOS: dict[str, tuple[dict[int, list[int]], bool]] = {
    "random": ({1: [7], 2: [5, 9]}, False),
    "only_rank0_experts": ({1: [4], 2: [6, 3]}, True),  # rank 1 receives nothing but still sends
    "idle_rank": ({1: [0], 2: [6, 0]}, False),  # a rank with no tokens still joins the collectives
}


def make_problem(
    scenario: str, world: int
) -> tuple[list[Tensor], list[Tensor], list[Tensor], Tensor, Tensor]:
    """Every rank's (hidden, topk_ids, topk_weights) and the full expert weights, from a fixed seed."""
    counts, rank0_only = SCENARIOS[scenario]
    g = torch.Generator().manual_seed(11 + len(scenario) + world)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5
    pool = EXPERTS // world if rank0_only else EXPERTS
    hidden, ids, weights = [], [], []
    for tokens in counts[world]:
        hidden.append(torch.randn(tokens, HIDDEN, generator=g))
        rows = [torch.randperm(pool, generator=g)[:TOP_K] for _ in range(tokens)]
        ids.append(torch.stack(rows).to(torch.int32) if rows else torch.empty(0, TOP_K, dtype=torch.int32))
        weights.append(torch.rand(tokens, TOP_K, generator=g) + 0.1)
    return hidden, ids, weights, w13, w2


def expected_received(
    rank: int, world: int, hidden: list[Tensor], ids: list[Tensor], weights: list[Tensor]
) -> list[tuple[float, int, Tensor]]:
    """(weight, local expert id, hidden row) of every (token, expert) pair of every rank owned by ``rank``."""
    per_rank = EXPERTS // world
    pairs = []
    for src in range(world):
        for t in range(ids[src].shape[0]):
            for j in range(TOP_K):
                expert = int(ids[src][t, j])
                if expert // per_rank == rank:
                    pairs.append((float(weights[src][t, j]), expert % per_rank, hidden[src][t]))
    return sorted(pairs, key=lambda p: p[0])


def run_rank(rank: int, world: int, group: object | None) -> None:
    """One rank's checks for every scenario (collective: all ranks call it)."""
    per_rank = EXPERTS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for scenario in SCENARIOS:
        hidden, ids, weights, w13, w2 = make_problem(scenario, world)
        dispatched = ep_dispatch(hidden[rank], ids[rank], weights[rank], EXPERTS, group)

        # What arrived is exactly the pairs this rank's experts own, from every rank.
        want = expected_received(rank, world, hidden, ids, weights)
        assert dispatched.local_expert_ids.dtype == torch.int32 and dispatched.weights.dtype == torch.float32
        got = sorted(
            zip(dispatched.weights.tolist(), dispatched.local_expert_ids.tolist(), dispatched.hidden),
            key=lambda p: p[0],
        )
        assert len(got) == len(want), f"{scenario}: rank {rank} received {len(got)} pairs, want {len(want)}"
        for (gw, ge, gh), (ww, we, wh) in zip(got, want):
            assert gw == ww and ge == we and torch.equal(gh, wh), f"{scenario}: wrong pair on rank {rank}"

        received = dispatched.hidden.shape[0]
        local_out = fused_moe(
            dispatched.hidden,
            w13[mine],
            w2[mine],
            torch.ones(received, 1),  # ep_combine applies the routing weights
            dispatched.local_expert_ids[:, None],
        )
        out = ep_combine(local_out, dispatched, group)
        expected = fused_moe(hidden[rank], w13, w2, weights[rank], ids[rank])
        assert out.shape == expected.shape, f"{scenario}: shape {tuple(out.shape)}"
        assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m, s=scenario: f"{s}, rank {rank}: {m}")


def worker_main(rank: int, world: int, port: int) -> None:
    """Subprocess entry point: join the gloo group, run the checks, always leave the group."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        if world == 1:

            def no_communication(*args: object, **kwargs: object) -> None:
                raise AssertionError("a world size of 1 must not communicate")

            dist.all_to_all_single = no_communication  # type: ignore[assignment]
        run_rank(rank, world, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}/{world}: ok")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [1, 2])
def test_ep_dispatch_combine_over_gloo_equals_single_process_fused_moe(world: int) -> None:
    """With the experts split contiguously over ``world`` gloo ranks, dispatch -> local fused_moe ->
    combine gives every rank the same output as fused_moe with all experts in one process; dispatch
    delivers exactly the owned pairs; a world size of 1 never calls all_to_all_single."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + DEADLINE_S
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        pytest.fail(f"EP ranks did not finish within {DEADLINE_S} s (hung collective?)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}\n{out}\n{err[-4000:]}"
        assert f"rank {rank}/{world}: ok" in out


def test_ep_without_group_is_local_and_equals_fused_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    """With group None, dispatch+combine around fused_moe equals fused_moe and touches no collective
    (torch.distributed is not even initialised here)."""

    def no_communication(*args: object, **kwargs: object) -> None:
        raise AssertionError("group None must not communicate")

    for name in ("all_to_all_single", "all_to_all", "all_gather", "all_reduce", "get_world_size", "get_rank"):
        monkeypatch.setattr(dist, name, no_communication)
    run_rank(0, 1, None)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
