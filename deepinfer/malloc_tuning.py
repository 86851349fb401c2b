"""glibc malloc tuning for the engine's processes (see FACTS.md: page faults can double a run's time).

Shared by the command-line entry points, which re-execute themselves with it, and the peer
benchmarks, which start their peers with it.
"""

from __future__ import annotations

import os
import sys

from deepinfer import envs
from deepinfer.threads import apply_thread_policy

# Thresholds raised so large temporaries stay in the heap (no mmap/munmap and page faults every step),
# and the heap advised for transparent huge pages (hugetlb=1, glibc >= 2.35; where the kernel's THP mode is
# "madvise", as here, nothing else turns them on): a decode step reads every weight once, and 2 MiB pages
# spare it thousands of TLB misses, which a VM's nested page tables make dear. One request's decode ran
# about 10% faster with it on this AMD host (8 alternated runs each, medians 1,325 vs 1,200 tok/s).
MALLOC_TUNABLES = (
    "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295:glibc.malloc.hugetlb=1"
)


def reexec_with_malloc_tuning() -> None:
    """Prepare a command-line entry point's process for the engine, before it imports torch: apply
    the OpenMP thread policy (:mod:`deepinfer.threads`; the re-exec inherits it), then re-execute
    this process once with glibc's malloc thresholds raised: without it, large temporaries are
    mmapped and unmapped every step and page faults can double the run time."""
    apply_thread_policy()
    if (
        os.environ.get("GLIBC_TUNABLES")
        or not envs.get("DEEPINFER_MALLOC_TUNING")
        or not sys.platform.startswith("linux")
    ):
        return
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
