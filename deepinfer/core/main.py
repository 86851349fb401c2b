"""``python -m deepinfer.core.main SPEC_JSON``: one engine core process (started by the API front).

It ties its life to the front's (``PR_SET_PDEATHSIG`` where Linux offers it; the core loop also
checks its parent), loads the engine, says ready and serves until told to stop. Only its front
stops it: SIGINT and SIGTERM, which a Ctrl-C, ``timeout``, systemd or a container runtime send to
the whole process group, are ignored, so the front can drain its requests through the core and then
send it ``Shutdown`` (a front that dies takes the core with it all the same). A failure while
loading is reported to the front as ``CoreFailed(during_startup=True)`` (a configuration error:
the front exits instead of restarting); the exit status is non-zero after any failure.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import zmq

from deepinfer.core import messages as m
from deepinfer.core.launch import CoreSpec, spec_from_argv
from deepinfer.logger import get_logger

logger = get_logger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL us when the front dies (Linux), and exit now if it already did."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        raise SystemExit(f"engine core: the front (pid {parent_pid}) is already gone")


def report_startup_failure(spec: CoreSpec, error: BaseException) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, m.identity(spec.engine_id))
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(spec.address)
    sock.send(m.encode(m.CoreFailed(spec.engine_id, f"{type(error).__name__}: {error}", True)))
    sock.close()
    context.term()


def main(argv: list[str]) -> int:
    spec = spec_from_argv(argv)
    die_with_parent(spec.parent_pid)
    for signum in (signal.SIGINT, signal.SIGTERM):  # sent to the whole group: the front drains us
        signal.signal(signum, signal.SIG_IGN)
    from deepinfer.core.engine_core import EngineCore
    from deepinfer.engine.llm_engine import LLMEngine

    parallel = spec.engine.data_parallel_size > 1  # core i is data-parallel rank i (deepinfer.parallel.core)
    try:
        if parallel:
            from deepinfer.parallel.core import DataParallelCore, build_rank

            rank = build_rank(spec.engine, spec.engine_id)
        else:
            engine = LLMEngine(spec.engine)
    except Exception as exc:
        logger.error("engine core %d could not start: %s", spec.engine_id, exc)
        report_startup_failure(spec, exc)
        return 2
    try:
        if parallel:
            try:
                DataParallelCore(rank, spec.engine_id, spec.address, spec.parent_pid).serve()
            finally:
                rank.close()
        else:
            EngineCore(engine, spec.engine_id, spec.address, spec.parent_pid).serve()
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
