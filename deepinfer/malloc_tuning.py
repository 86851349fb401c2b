"""glibc malloc tuning for the engine's processes (see FACTS.md: page faults can double a run's time).

Shared by the command-line entry points, which re-execute themselves with it, and the peer
benchmarks, which start their peers with it.
"""

from __future__ import annotations

import os
import sys

from deepinfer import envs

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"


def reexec_with_malloc_tuning() -> None:
    """Re-execute this process once with glibc's malloc thresholds raised: without it, large
    temporaries are mmapped and unmapped every step and page faults can double the run time."""
    if (
        os.environ.get("GLIBC_TUNABLES")
        or not envs.get("DEEPINFER_MALLOC_TUNING")
        or not sys.platform.startswith("linux")
    ):
        return
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
