"""The API front's CPU priority: below its engine cores', so HTTP work waits for the step loop.

Where the front's event loop shares CPU cores with an engine core (a CPU box of a few cores; any
host with fewer cores than busy threads), every burst of HTTP work the front does after a step (one
SSE write per stream, the next requests' parsing) lands while the core is already in its next step,
and on a core the step needs: an intra-op thread preempted inside a parallel region stalls the whole
region until it runs again. With the front's threads at a lower priority (a higher ``nice``
value), the kernel runs the front in the gaps the step leaves (its single-threaded parts) and on a
busy core only at a small share (on a loaded host it also answered more events per wake-up: less
front CPU per token).

Off by default (``--front-nice 0``): measured on a 2-core host it moves served throughput at
saturation little (within the noise of the served/offline benchmark), but where a second worker's
engine core shares the host (the P/D benchmark, ``bench/pd_itl.py``) the lowered front waits behind
that core and the decode worker's ITL p99 under long prompts rose from 1.14x to 1.79x its value
without them. It is for hosts where the front only competes with its own cores.

Linux keeps a nice value per thread, and a child process inherits the value of the thread that
started it. :class:`CoreSpawner` is the one thread that keeps the process's original priority: the
front starts its engine cores (and restarts them) through it, so the cores run at the original
priority, not the front's. :func:`lower_front_priority` then raises the nice value of every other
thread of the process; threads started afterwards inherit it from the thread that starts them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from deepinfer.logger import get_logger

logger = get_logger(__name__)

T = TypeVar("T")
MAX_NICE = 19


class CoreSpawner:
    """A thread at this process's original priority that starts engine-core processes.

    Created by the server's launcher before :func:`lower_front_priority`; ``run(fn, *args)`` calls
    ``fn`` on that thread and returns its result (or raises its exception). ``close`` ends the thread.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-core-spawner")
        self.native_id: int = self._pool.submit(threading.get_native_id).result()

    def run(self, fn: Callable[..., T], *args: object) -> T:
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def lower_front_priority(increment: int, keep: set[int]) -> int:
    """Add ``increment`` (0-19) to the nice value of every thread of this process except those whose
    native thread id is in ``keep``; returns how many threads it lowered. Linux only: elsewhere a nice
    value is per process and would pass to the engine cores, so there the front keeps its priority
    (with a warning saying so)."""
    if not 0 <= increment <= MAX_NICE:
        raise ValueError(f"--front-nice must be 0-{MAX_NICE}, got {increment}")
    if increment == 0:
        return 0
    if not sys.platform.startswith("linux"):
        logger.warning(
            "--front-nice %d: per-thread nice values need Linux (this is %s); the API front keeps its "
            "priority", increment, sys.platform,
        )  # fmt: skip
        return 0
    lowered = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in keep:
            continue
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + increment))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        lowered += 1
    logger.info("API front: %d threads at nice +%d (engine cores keep their priority)", lowered, increment)
    return lowered
