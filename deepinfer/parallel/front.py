"""The offline front of data-parallel ranks on one host: ``LLM(data_parallel_size=N, ...)``.

``DataParallelEngine`` offers the LLMEngine interface the offline API drives (``add_request``,
``step``, ``abort_request``, ``has_unfinished_requests``) over N rank processes it spawns (spawn start
method, one torch.distributed group on loopback). Each rank process runs ``rank_process``: a
``DataParallelRank`` stepped in a loop, taking commands between steps over a pipe and sending back
outputs with its load. New requests go to the rank with the fewest active requests, then the lowest
KV-cache occupancy (DeepSeek's decode rule).

Failure: a rank that dies is seen at once (its process sentinel); the others fail their next
collective within ``dp_timeout_s`` and report it; either way ``step`` raises ``RankFailedError`` and
every rank process is stopped by PID. Rank processes are daemonic, so they never outlive the front.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import socket
import time
from contextlib import suppress
from multiprocessing.connection import Connection, wait
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.logger import get_logger
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader import Checkpoint
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.placement import check_expert_parallel
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer

logger = get_logger(__name__)

IDLE_WAIT_S = (0.001, 0.02)  # a rank with nothing to do polls again after 1 ms, backing off to 20 ms
STARTUP_TIMEOUT_S = 600.0
POLL_S = 0.5


class RankFailedError(RuntimeError):
    """A data-parallel rank died, hung past the process-group timeout, or raised."""


def rank_process(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Entry point of one rank process: join the group, build the rank, serve commands, step."""
    from deepinfer.parallel.rank import DataParallelRank, init_group

    dp_rank = None
    try:
        init_group(config, rank, init_method)
        dp_rank = DataParallelRank(config, rank)
        conn.send(("ready", dp_rank.load()))
        wait_s = IDLE_WAIT_S[0]
        while True:
            while conn.poll():
                _handle(dp_rank, conn, conn.recv())
            step = dp_rank.step()
            if step.outputs:
                conn.send(("outputs", step.outputs, dp_rank.load()))
            if step.stop:
                conn.send(("stopped", dp_rank.load(), dp_rank.stats))
                break
            if step.tokens == 0 and not step.any_work:
                conn.poll(wait_s)  # wakes early when the front sends something
                wait_s = min(wait_s * 2, IDLE_WAIT_S[1])
            else:
                wait_s = IDLE_WAIT_S[0]
    except BaseException as exc:  # report, then exit non-zero: the front raises RankFailedError
        with suppress(Exception):
            conn.send(("fatal", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        if dp_rank is not None:
            dp_rank.close()


def _handle(dp_rank: Any, conn: Connection, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
        _, request_id, prompt, ids, params = message
        try:
            dp_rank.add_request(request_id, prompt, ids, params)
        except ValueError as exc:
            conn.send(("rejected", request_id, str(exc)))
    elif kind == "abort":
        dp_rank.abort_request(message[1])
    elif kind == "stats":
        conn.send(("stats", dp_rank.stats, dp_rank.load()))
    elif kind == "stop":
        dp_rank.request_stop()
    else:
        raise ValueError(f"unknown command {kind!r}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DataParallelEngine:
    """N data-parallel ranks behind the LLMEngine interface (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.nnodes > 1:
            raise ValueError(
                "nnodes > 1: the offline front starts ranks on one host only; several hosts need the "
                "engine-core server (see README, Parallelism)"
            )
        check_expert_parallel(ModelConfig.from_dict(Checkpoint.open(config.model).raw_config), config)
        self.config = config
        tokenizer_dir = config.tokenizer or config.model
        self.tokenizer = (
            Tokenizer(tokenizer_dir)
            if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json"))
            else None
        )
        world = config.data_parallel_size
        port = config.master_port or _free_port()
        init_method = f"tcp://{config.master_addr or '127.0.0.1'}:{port}"
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        gloo_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        if config.master_addr is None:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one host: the ranks talk over loopback
        try:
            for rank in range(world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=rank_process,
                    args=(config, rank, init_method, child),
                    name=f"deepinfer-dp-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        finally:
            if gloo_ifname is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
        self.loads: list[Any] = [None] * world
        self.stats: list[Any] = [None] * world
        self._active: list[set[str]] = [set() for _ in range(world)]
        self._rank_of: dict[str, int] = {}
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []
        self._failures: list[str] = []  # what failed ranks reported
        self._closed = False
        try:
            self._await(lambda: all(load is not None for load in self.loads), STARTUP_TIMEOUT_S, "start")
        except BaseException:
            self.close(graceful=False)
            raise

    # ------------------------------------------------------------------ the LLMEngine interface
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> None:
        """Send the request to the least-loaded rank (fewest active requests, then KV occupancy). A
        request the rank rejects (bad prompt, too long ...) raises ValueError from the next ``step``."""
        if request_id in self._rank_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        rank = min(range(len(self.conns)), key=lambda r: (len(self._active[r]), self.loads[r].kv_usage, r))
        self.conns[rank].send(("add", request_id, prompt, prompt_token_ids, params))
        self._active[rank].add(request_id)
        self._rank_of[request_id] = rank

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            rank = self._rank_of.pop(rid, None)
            if rank is not None:
                self._active[rank].discard(rid)
                by_rank.setdefault(rank, []).append(rid)
        if self._closed:
            return
        for rank, rids in by_rank.items():
            with suppress(OSError):
                self.conns[rank].send(("abort", rids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._rank_of)

    def step(self) -> list[RequestOutput]:
        """Outputs that arrived from any rank (waits until some do, while requests are unfinished)."""
        if not self._pending and self._rank_of:
            self._await(lambda: bool(self._pending) or not self._rank_of, None, "generate")
        outputs, self._pending = self._pending, []
        return outputs

    def collect_stats(self) -> list[Any]:
        """Every rank's ``RankStats`` and load (asks the ranks; they answer between steps)."""
        self.stats = [None] * len(self.conns)
        for conn in self.conns:
            conn.send(("stats",))
        self._await(lambda: all(s is not None for s in self.stats), self.config.dp_timeout_s, "stats")
        return list(self.stats)

    # ------------------------------------------------------------------ messages
    def _await(self, done: Any, timeout: float | None, what: str) -> None:
        """Receive rank messages until ``done()``; raise RankFailedError when a rank dies or reports a
        failure, or when ``timeout`` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"data-parallel ranks did not {what} within {timeout:.0f} s")
            ready = wait([*self.conns, *(p.sentinel for p in self.procs)], timeout=POLL_S)
            for item in ready:
                if item in self.conns:
                    rank = self.conns.index(item)
                    try:
                        message = item.recv()
                    except (EOFError, OSError):
                        continue  # the sentinel reports the exit
                    self._receive(rank, message)
            if self._failures:
                self._fail(self._failures[0])
            for rank, proc in enumerate(self.procs):
                if not proc.is_alive() and not self._closed:
                    while self.conns[rank].poll():  # a last report explains the exit
                        try:
                            self._receive(rank, self.conns[rank].recv())
                        except (EOFError, OSError):
                            break
                    self._fail(f"data-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _receive(self, rank: int, message: tuple) -> None:
        kind = message[0]
        if kind in ("ready", "stopped"):
            self.loads[rank] = message[1]
            if kind == "stopped":
                self.stats[rank] = message[2]
        elif kind == "outputs":
            _, outputs, load = message
            self.loads[rank] = load
            for out in outputs:
                if out.finished and self._rank_of.pop(out.request_id, None) is not None:
                    self._active[rank].discard(out.request_id)
            self._pending.extend(outputs)
        elif kind == "stats":
            self.stats[rank], self.loads[rank] = message[1], message[2]
        elif kind == "rejected":
            _, request_id, reason = message
            self._rank_of.pop(request_id, None)
            self._active[rank].discard(request_id)
            raise ValueError(reason)
        elif kind == "fatal":
            self._failures.append(message[1])

    def _fail(self, reason: str) -> None:
        """Let the surviving ranks fail on their own (their next collective errors within
        ``dp_timeout_s``) and collect what they report, then stop them all and raise."""
        deadline = time.monotonic() + self.config.dp_timeout_s + 5.0
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        while alive and time.monotonic() < deadline:
            wait([self.procs[r].sentinel for r in alive] + [self.conns[r] for r in alive], timeout=POLL_S)
            for r in alive:
                while self.conns[r].poll():
                    try:
                        message = self.conns[r].recv()
                    except (EOFError, OSError):
                        break
                    if message[0] == "fatal":
                        self._failures.append(message[1])
            alive = [r for r in alive if self.procs[r].is_alive()]
        exits = [  # the ranks that died on their own (before the close below kills the rest)
            f"data-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs)
            if not p.is_alive() and p.exitcode != 0
        ]
        self.close(graceful=False)
        reports = [f for f in [*self._failures, *exits] if f != reason]
        raise RankFailedError("; ".join([reason, *reports]))

    def close(self, graceful: bool = True, timeout: float = 30.0) -> None:
        """Stop every rank together (graceful: through the lockstep) and reap the processes; any rank
        still alive after ``timeout`` is killed by PID."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self.conns:
                with suppress(OSError):
                    conn.send(("stop",))
        deadline = time.monotonic() + (timeout if graceful else 0.0)
        for proc in self.procs:
            if graceful:
                self._drain_until_exit(proc, deadline)
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self._rank_of.clear()

    def _drain_until_exit(self, proc: Any, deadline: float) -> None:
        rank = self.procs.index(proc)
        while proc.is_alive() and time.monotonic() < deadline:
            if self.conns[rank].poll(0.05):
                with suppress(EOFError, OSError, ValueError, RankFailedError):
                    message = self.conns[rank].recv()
                    if message[0] in ("stopped", "stats"):
                        self._receive(rank, message)

    def __del__(self) -> None:
        with suppress(Exception):
            self.close()
