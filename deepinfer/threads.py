"""The OpenMP thread policy of every process that runs the engine: ``deepinfer run`` / ``bench`` /
``serve`` (and ``python -m deepinfer.run``), ``LLM()``, and the served engine core.

PyTorch's CPU kernels run on OpenMP (libgomp). An OpenMP worker that finishes its share of a parallel
region waits for the next one, spinning ``GOMP_SPINCOUNT`` times before it sleeps. The runtime's default
(300,000 spins, about 3 ms) makes a worker whose partner was preempted burn the core another thread
needs: on a host where other programs run, offline decoding fell to 5-20 tok/s. Never spinning
(``OMP_WAIT_POLICY=PASSIVE``) is no cure on a VM: every parallel region then wakes a halted vCPU, and
one request's decode on this 2-vCPU host ran at 290 tok/s idle against 1,770 with spinning. So the
policy is a short spin, ``GOMP_SPINCOUNT=10000`` (about 0.1 ms: the gaps between one step's parallel
regions, not the idle time between steps); it is applied unless the user set ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` (either is kept as given). Beside it, the engine takes only the cores that are free
when it starts (:func:`free_cores`), so two threads never wait on each other behind busy neighbours.

The OpenMP runtime reads its environment once, when it is loaded (by ``import torch``), so the policy
is set in the process environment before that: the command-line entry points do it before they
import torch (and their malloc re-exec carries it), ``LLM()`` before it first imports the engine,
and the core's parent puts it in the core's environment (:func:`thread_environment`). A process that
imported torch before ``LLM()`` keeps the runtime's default; :func:`apply_thread_policy` says so and
``LLM()`` logs a line naming the fix.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

#: The policy: variables and the values they take unless the user chose a wait policy.
THREAD_POLICY: dict[str, str] = {"GOMP_SPINCOUNT": "10000"}
#: Variables by which a user chooses the wait policy; any of them set means the policy stays out.
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _policy_for(environ: Mapping[str, str]) -> dict[str, str]:
    return {} if any(name in environ for name in USER_CHOICES) else dict(THREAD_POLICY)


def thread_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the policy's values unless it chose a wait policy (a child process's
    environment)."""
    return {**_policy_for(environ), **environ}


def apply_thread_policy() -> bool:
    """Put the policy's values the user did not set into this process's environment, if the OpenMP
    runtime has not read it yet. Returns whether the policy (or the user's own choice) is in force:
    False when OpenMP was already loaded (torch imported) with the policy unset, which only a new
    process can change."""
    missing = _policy_for(os.environ)
    if not missing:
        return True
    if openmp_loaded():
        return False
    os.environ.update(missing)
    return True


def openmp_loaded() -> bool:
    """Whether an OpenMP runtime is mapped into this process (Linux: ``/proc/self/maps``; elsewhere,
    whether torch, which loads it, has been imported)."""
    maps = Path("/proc/self/maps")
    if maps.is_file():
        text = maps.read_text(errors="replace")
        return any(name in text for name in ("libgomp", "libiomp", "libomp."))
    return "torch" in sys.modules


def policy_warning() -> str:
    """The line ``LLM()`` logs when :func:`apply_thread_policy` came too late."""
    settings = " ".join(f"{k}={v}" for k, v in THREAD_POLICY.items())
    return (
        f"OpenMP was loaded (torch imported) before deepinfer could set {settings}: its idle threads "
        "spin, and on a host where other programs run, decoding can be several times slower. Start "
        f"Python with {settings} in the environment (deepinfer run, bench and serve set it themselves), "
        "or create the LLM before importing torch"
    )


def free_cores(samples: int = 5, interval_s: float = 0.01) -> int:
    """The CPUs this process may run on that other programs are not using now: the affinity mask's
    size minus the runnable tasks of the whole host other than this one (``procs_running`` of
    ``/proc/stat``, the median of ``samples`` readings ``interval_s`` apart), at least 1. Without
    ``/proc/stat`` (not Linux), every CPU of the mask."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    stat = Path("/proc/stat")
    if not stat.is_file():
        return cores
    readings = []
    for i in range(samples):
        for line in stat.read_text().splitlines():
            if line.startswith("procs_running "):
                readings.append(int(line.split()[1]))
        if i + 1 < samples:
            time.sleep(interval_s)
    if not readings:
        return cores
    others = max(0, sorted(readings)[len(readings) // 2] - 1)  # this process's reading thread runs
    return max(1, cores - others)
