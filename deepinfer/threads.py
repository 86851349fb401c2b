"""The OpenMP thread policy of every process that runs the engine: ``deepinfer run`` / ``bench`` /
``serve`` (and ``python -m deepinfer.run``), ``LLM()``, and the served engine core.

PyTorch's CPU kernels run on OpenMP (libgomp). By default an OpenMP worker that finishes its share of
a parallel region spins, waiting for the next one, instead of sleeping. On a host where other
programs run, a spinning worker whose partner was preempted burns the core another thread needed:
offline decoding fell to 5-20 tok/s next to two busy processes, and ran at 160-250 tok/s with
``OMP_WAIT_POLICY=PASSIVE`` (idle workers sleep); the served core measured 12 vs 108 tok/s at 64
streaming clients on 2 shared cores. So every engine process runs with ``OMP_WAIT_POLICY=PASSIVE``
unless the user set ``OMP_WAIT_POLICY`` (any value, e.g. ``ACTIVE``, is kept).

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
from collections.abc import Mapping
from pathlib import Path

#: The policy: variables and the values they take unless the user set them.
THREAD_POLICY: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


def thread_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the policy's values where it sets none (a child process's environment)."""
    return {**THREAD_POLICY, **environ}


def apply_thread_policy() -> bool:
    """Put the policy's values the user did not set into this process's environment, if the OpenMP
    runtime has not read it yet. Returns whether the policy (or the user's own choice) is in force:
    False when OpenMP was already loaded (torch imported) with the policy unset, which only a new
    process can change."""
    missing = {name: value for name, value in THREAD_POLICY.items() if name not in os.environ}
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
