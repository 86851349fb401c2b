"""glibc malloc tuning for the engine's processes (see FACTS.md: page faults can double a run's time).

Shared by the command-line entry points, which re-execute themselves with it, and the peer
benchmarks, which start their peers with it.
"""

from __future__ import annotations

import os
import sys

from deepinfer import envs
from deepinfer.logger import get_logger
from deepinfer.threads import apply_thread_policy, policy_warning, thread_environment

logger = get_logger(__name__)

# Thresholds raised so large temporaries stay in the heap (no mmap/munmap and page faults every step),
# and the heap advised for transparent huge pages (hugetlb=1, glibc >= 2.35; where the kernel's THP mode is
# "madvise", as here, nothing else turns them on): a decode step reads every weight once, and 2 MiB pages
# spare it thousands of TLB misses, which a VM's nested page tables make dear. One request's decode ran
# about 10% faster with it on this AMD host (8 alternated runs each, medians 1,325 vs 1,200 tok/s).
MALLOC_TUNABLES = (
    "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295:glibc.malloc.hugetlb=1"
)


def reexec_with_malloc_tuning() -> None:
    """Prepare an entry point's process for the engine (call it first, before heavy work): apply
    the OpenMP thread policy (:mod:`deepinfer.threads`), and re-execute this process once with what
    only a new process can take: glibc's malloc thresholds raised (without them, large temporaries
    are mmapped and unmapped every step and page faults can double the run time), and the thread
    policy when OpenMP was already loaded (a script that imported torch first). With
    ``DEEPINFER_MALLOC_TUNING`` false it never re-executes (the thread policy then holds only if
    OpenMP was not loaded yet; otherwise a warning says so)."""
    in_force = apply_thread_policy()
    if not envs.get("DEEPINFER_MALLOC_TUNING"):
        # No re-exec at all: a caller that runs ``main()`` inside its own process (a test under pytest,
        # an embedding program) must never have that process replaced.
        if not in_force:
            logger.warning("%s", policy_warning())
        return
    env = dict(os.environ) if in_force else thread_environment(os.environ)
    if not os.environ.get("GLIBC_TUNABLES") and sys.platform.startswith("linux"):
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    if env != dict(os.environ) and os.name == "posix":
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
