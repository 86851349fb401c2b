"""A data-parallel rank as an engine-core server process (``deepinfer serve --data-parallel-size N``).

The API front starts N engine cores (``deepinfer.core``); with ``data_parallel_size > 1`` core i is
rank i: ``core/main.py`` calls ``serve_rank``, which joins the group, builds a ``DataParallelRank``
and serves it with ``DataParallelCore``. That is the engine core's loop with one change: every
iteration runs the lockstep ``DataParallelRank.step`` (a collective), so a core does not block on its
socket while any rank has work; when no rank has work it waits for a message a little (1 ms backing
off to 20 ms) and steps again. Shutdown from the front makes every rank stop after the same
iteration. A rank that dies makes the others' next collective fail (within ``dp_timeout_s``): their
cores report ``CoreFailed`` and exit, and the front fails the requests and exits non-zero.

Stats: a core sends its stats with its outputs, and, while the ranks compute, at least every
``STATS_INTERVAL_S`` (a rank without requests of its own still computes for the others' tokens: its
expert load, ``EngineStats.expert_tokens_per_step``, is what the front's per-rank metrics show).
"""

from __future__ import annotations

import msgspec
import zmq

from deepinfer.core import messages as m
from deepinfer.core.engine_core import EngineCore
from deepinfer.logger import get_logger
from deepinfer.parallel.rank import DataParallelRank, init_group

logger = get_logger(__name__)

IDLE_WAIT_MS = (1, 20)
ORPHAN_CHECK_S = 1.0
STATS_INTERVAL_S = 0.5


class DataParallelCore(EngineCore):
    """The engine-core loop around a lockstep rank (see the module docstring)."""

    def __init__(self, rank: DataParallelRank, engine_id: int, address: str, parent_pid: int | None) -> None:
        super().__init__(rank.engine, engine_id, address, parent_pid)
        self.rank = rank

    def _stats(self) -> m.EngineStats:
        stats = super()._stats()
        if self.rank.recorder is None:
            return stats
        return msgspec.structs.replace(stats, expert_tokens_per_step=self.rank.recorder.received_per_step())

    def _loop(self, sock: zmq.Socket) -> None:
        import time

        wait_ms = IDLE_WAIT_MS[0]
        last_check = last_stats = time.monotonic()
        while True:
            commands = []
            while sock.poll(0):
                commands.append(m.decode_to_core(sock.recv()))
            accepted, refusals, stop = self._apply(commands)
            if stop:
                self.rank.request_stop()
            if accepted or refusals:
                sock.send(m.encode(m.StepOutputs(self.engine_id, accepted, refusals, [], self._stats())))
            started = time.monotonic()
            step = self.rank.step()
            if step.stop:
                self._sent.clear()
                return
            if step.outputs or commands or (step.tokens and started - last_stats > STATS_INTERVAL_S):
                deltas = self._deltas(step.outputs, started)
                sock.send(m.encode(m.StepOutputs(self.engine_id, [], [], deltas, self._stats())))
                last_stats = started
            if step.tokens or step.any_work:
                wait_ms = IDLE_WAIT_MS[0]
                continue
            sock.poll(wait_ms)  # idle everywhere: wake early for a message
            wait_ms = min(wait_ms * 2, IDLE_WAIT_MS[1])
            if time.monotonic() - last_check > ORPHAN_CHECK_S:
                last_check = time.monotonic()
                if self._orphaned():
                    logger.warning(
                        "rank %d: the front (pid %s) is gone; exiting", self.rank.rank, self.parent_pid
                    )
                    return


def build_rank(config, engine_id: int) -> DataParallelRank:
    """Join the group as rank ``engine_id`` (rendezvous at ``master_addr:master_port``) and build it."""
    if config.master_port is None:
        raise ValueError("master_port must be set for data-parallel engine cores (the front picks one)")
    init_group(config, engine_id, f"tcp://{config.master_addr or '127.0.0.1'}:{config.master_port}")
    return DataParallelRank(config, engine_id)
