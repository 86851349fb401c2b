"""The engine, driven from asyncio: one background thread owns the ``LLMEngine``.

The event loop never touches the engine. ``submit`` and aborts are commands, handed to the engine
thread through a queue guarded by a condition variable; the thread applies them between steps,
runs ``step()`` while there is work, and sleeps on the condition when idle (no polling). Which
requests it took or refused, then each step's outputs, go back to the loop in one
``call_soon_threadsafe`` each and are handed to the per-request :class:`RequestStream` s. After every
iteration the thread publishes an immutable :class:`EngineStats` snapshot for ``/metrics`` and the
tests. If ``step()`` raises, every request fails with :class:`EngineDead` and the thread ends.

Admission is bounded: at most ``max_num_seqs + max_queued_requests`` requests are in flight;
``submit`` raises :class:`QueueFull` beyond that. A request whose consumer goes away (a client that
disconnects) is aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.logger import get_logger
from deepinfer.outputs import RequestOutput
from deepinfer.router.load import EngineLoad, engine_load
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine

logger = get_logger(__name__)


class QueueFull(Exception):
    """Every admission slot is taken; try again later."""


class EngineDead(RuntimeError):
    """The engine thread stopped after an error; no request can be served."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine thread last saw (published after each iteration)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int = 0  # of which found
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # speculative decoding, since start
    load: EngineLoad = field(default_factory=EngineLoad)  # what routers see (GET /load)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class RequestStream:
    """The outputs of one engine request, as an async iterator of cumulative ``RequestOutput``s.

    Outputs are cumulative, so only the newest matters: a consumer that falls behind gets the
    latest state rather than a backlog (memory stays bounded however slow the client). Use it as a
    context manager (or call ``close``): leaving before the request finished aborts it. A request the
    engine refused raises its error (``ValueError``) from the iterator.
    """

    def __init__(self, owner: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._owner = owner
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._taken = asyncio.Event()
        self._done = False

    def _accept(self) -> None:
        self._taken.set()

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._taken.set()
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._taken.set()
        self._ready.set()

    async def accepted(self) -> None:
        """Wait until the engine has taken the request (at most one step); raises its refusal
        (``ValueError``: an invalid prompt or output constraint)."""
        await self._taken.wait()
        if self._error is not None:
            raise self._error

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            self._done = True
            raise self._error
        output, self._latest = self._latest, None
        self._done = output.finished
        return output

    def close(self) -> None:
        self._owner._release(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncEngine:
    """Serves an ``LLMEngine`` to asyncio code; see the module docstring."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int) -> None:
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_queued_requests
        self._busy_s = 0.0  # time in engine steps, since start (the engine thread's)
        self.stats = self._snapshot()
        self.error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # in flight: admitted, not finished or aborted
        self._commands: deque[_Add | _Abort] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    # ------------------------------------------------------------------ lifecycle (event loop)
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread; unfinished requests are aborted (their blocks freed)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests (event loop)
    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> RequestStream:
        """Admit a request; raises ``QueueFull`` when every slot is taken, ``EngineDead`` after a
        fatal engine error."""
        if not self.healthy:
            raise EngineDead(
                f"the engine is not running ({self.error!r})" if self.error else "the engine is not running"
            )
        if len(self._streams) >= self.capacity:
            raise QueueFull(f"{len(self._streams)} requests in flight (the limit is {self.capacity})")
        request_id = f"srv-{next(self._ids)}"
        stream = self._streams[request_id] = RequestStream(self, request_id)
        self._push(_Add(request_id, prompt, prompt_token_ids, params))
        return stream

    def _release(self, request_id: str) -> None:
        """The consumer is done with a request: abort it unless it already ended."""
        if self._streams.pop(request_id, None) is not None:
            self._push(_Abort(request_id))

    def _push(self, command: _Add | _Abort) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _deliver(
        self, accepted: list[str], outputs: list[RequestOutput], failures: list[tuple[str, BaseException]]
    ) -> None:
        for request_id in accepted:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream._accept()
        for request_id, error in failures:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._fail(error)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # closed by its consumer; its abort is on the way
            if output.finished:
                del self._streams[output.request_id]
            stream._put(output)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(EngineDead(f"the engine failed: {error!r}"))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        live: set[str] = set()
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                accepted, failures = self._apply(commands, live)
                if accepted or failures:  # tell the waiting handlers before the (maybe long) step
                    self._call_loop(self._deliver, accepted, [], failures)
                started = time.perf_counter()
                outputs = engine.step() if engine.has_unfinished_requests() else []
                self._busy_s += time.perf_counter() - started
                live.difference_update(o.request_id for o in outputs if o.finished)
                self.stats = self._snapshot()
                if outputs:
                    self._call_loop(self._deliver, [], outputs, [])
        except Exception as exc:
            logger.exception("the engine thread failed; the server can no longer generate")
            self.error = exc
            self._call_loop(self._fail_all, exc)
        finally:
            if self.error is None:  # after a failure the engine's state is unknown: leave it be
                engine.abort_request(list(live))
                self.stats = self._snapshot()

    def _apply(
        self, commands: list[_Add | _Abort], live: set[str]
    ) -> tuple[list[str], list[tuple[str, BaseException]]]:
        """Apply queued commands; returns the requests added and those the engine refused."""
        accepted, failures = [], []
        for command in commands:
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                live.discard(command.request_id)
                continue
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.prompt_token_ids, command.params
                )
            except ValueError as exc:
                failures.append((command.request_id, exc))
            else:
                live.add(command.request_id)
                accepted.append(command.request_id)
        return accepted, failures

    def _call_loop(self, callback, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under us at shutdown: nobody listens
            self._loop.call_soon_threadsafe(callback, *args)

    def _snapshot(self) -> EngineStats:
        engine = self.engine
        kv = engine.kv_cache
        return EngineStats(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_blocks=kv.pool.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            spec=replace(engine.spec_stats),
            load=engine_load(engine, self._busy_s),
        )
