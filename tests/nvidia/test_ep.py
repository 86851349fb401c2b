"""ops_cuda's ep_dispatch / ep_combine pass the reference's multi-rank EP checks.

The ranks are subprocesses running this module joined in a gloo group on CPU tensors, so the combine kernel
runs in Triton's interpreter; the checks themselves (exactly the owned pairs arrive, dispatch -> local
experts -> combine equals single-process fused_moe, a world of 1 never communicates) are those of
``tests/backends/test_ep_distributed.py``, pointed at this backend's functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.backends import test_ep_distributed as ep_checks

REPO_ROOT = ep_checks.REPO_ROOT

DEADLINE_S = 180


@pytest.mark.parametrize("world", [1, 2])
def test_ep_over_gloo_matches_single_process_fused_moe(world: int) -> None:
    pytest.importorskip("triton")
    port = ep_checks.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, str(rank), str(world), str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + DEADLINE_S
    try:
        outputs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
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


if __name__ == "__main__":
    from deepinfer.ops_cuda import ep

    ep_checks.ep_dispatch, ep_checks.ep_combine = ep.ep_dispatch, ep.ep_combine
    ep_checks.worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
