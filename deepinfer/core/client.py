"""The API front's side of the engine channel: asyncio, one ROUTER socket, one or more cores.

:class:`EngineClient` starts its cores through a launcher (``(engine_id, address) -> CoreHandle``),
waits for each to say ready, then turns ``submit`` calls into :class:`~deepinfer.core.messages.AddRequest`
messages for the least-loaded core and the cores' token deltas back into cumulative
``RequestOutput`` s, one :class:`RequestStream` per request. Text is made here, not in the core: a
request submitted with ``detokenize=True`` gets its completions' text (and its log-probabilities'
token strings) from an incremental detokenizer in this process.

The channel: one ZeroMQ ROUTER socket. Each core connects through its own ``ipc://`` endpoint, a
socket file in a private folder (``mkdtemp``: mode 0700, so only this user can reach it), and once
the core said ready the file and its folder are removed: nothing else can connect, and a front that
is killed leaves nothing behind (a restarted core gets a fresh endpoint). A frame from a core is
trusted only as far as its ZeroMQ identity goes: a core speaks for the engine id it was started as
and for the requests given to it; a frame that claims otherwise, or that does not decode, is dropped
and counted (``dropped_messages``), never fatal to the reader.

Sends never drop a message: one that the core's pipe has no room for (its high-water mark) waits in
that core's outbox and leaves, in order, as room frees up. An ``AddRequest`` that cannot leave
within ``send_timeout_s`` fails its request with :class:`EngineDead` (the core stopped reading);
aborts and ``Shutdown`` wait as long as their core lives.

Supervision: a watcher per core waits for its process to end. When a core dies (an exception, kill
-9, the OOM killer), every request it held fails at once with :class:`EngineDead`, the client is
unhealthy, and then either the core is restarted (``restart=True``, once it had been ready) or
``on_fatal`` is called (the server exits non-zero). Requests past their deadline
(``request_timeout_s``) fail with :class:`RequestTimedOut` and are aborted in their core, which
frees their KV blocks. Timestamps (``RequestMetrics``) are this process's: arrival is when the HTTP
request arrived, first token / finish when the front received them.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from deepinfer.core import messages as m
from deepinfer.core.launch import CoreHandle
from deepinfer.core.load import combined_load
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.logger import get_logger
from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer

logger = get_logger(__name__)

Launcher = Callable[[int, str], CoreHandle]
READ_WAKE_MS = 100
SEND_TIMEOUT_S = 30.0  # an AddRequest the core's channel has no room for fails after this long
SEND_RETRY_S = (0.001, 0.05)  # a full outbox retries after 1 ms, backing off to 50 ms
DROP_LOG_LIMIT = 20  # dropped frames logged one by one; later ones only counted
# bytes: a Unix socket's path and its NUL must fit in sun_path (108 bytes on Linux, 104 elsewhere)
MAX_IPC_PATH = 107 if sys.platform.startswith("linux") else 103


class QueueFull(Exception):
    """Every admission slot is taken; try again later."""


class EngineDead(RuntimeError):
    """No engine core can serve the request (it failed, or is restarting)."""


class RequestTimedOut(Exception):
    """The request ran past its deadline and was aborted."""


class RequestRefused(ValueError):
    """The core refused the request as invalid; ``field`` is the ``SamplingParams`` field at fault
    when known."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


class CoreStartupError(RuntimeError):
    """A core failed before it became ready (the message says why)."""


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative ``RequestOutput`` s.

    Only the newest output matters (they are cumulative), so a slow consumer gets the latest state,
    not a backlog. Use it as a context manager (or call ``close``): leaving before the request
    finished aborts it. A refused or failed request raises its error from the iterator. The lists in
    an output (token ids, log-probabilities) keep growing while the request runs: read, never mutate.
    """

    def __init__(self, owner: EngineClient, request_id: str) -> None:
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
        """Wait until the core has taken the request (before it runs a step); raises its refusal."""
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


@dataclass(slots=True)
class _Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class _Tracked:
    """A request in flight, as the front reassembles it."""

    stream: RequestStream
    engine_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    deadline: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _Outgoing:
    """A message waiting for room in its core's pipe; ``request_id``: an AddRequest's, which fails
    at ``deadline`` (loop time) if still here."""

    frames: list[bytes]
    request_id: str | None
    deadline: float


@dataclass(slots=True)
class _Core:
    handle: CoreHandle
    ready: m.Ready | None = None
    stats: m.EngineStats = field(default_factory=m.EngineStats)
    failure: str | None = None  # what its CoreFailed said
    alive: bool = True
    in_flight: int = 0
    outbox: deque[_Outgoing] = field(default_factory=deque)
    sender: asyncio.Task | None = None  # drains the outbox while it is not empty


class EngineClient:
    """See the module docstring. ``max_queued_requests``: requests admitted beyond the cores'
    ``max_num_seqs``; more get :class:`QueueFull`. ``send_timeout_s``: how long an ``AddRequest``
    may wait for room in its core's channel; ``send_hwm``: the channel's high-water mark (messages
    queued per core in ZeroMQ before the outbox holds them; ZeroMQ's default when None)."""

    def __init__(
        self,
        launcher: Launcher,
        tokenizer: Tokenizer | None,
        max_queued_requests: int,
        *,
        num_cores: int = 1,
        restart: bool = False,
        on_fatal: Callable[[str], None] | None = None,
        request_timeout_s: float | None = None,
        ready_timeout_s: float = 900.0,
        send_timeout_s: float = SEND_TIMEOUT_S,
        send_hwm: int | None = None,
    ) -> None:
        self._launcher = launcher
        self.tokenizer = tokenizer
        self.max_queued_requests = max_queued_requests
        self.num_cores = num_cores
        self.restart = restart
        self._on_fatal = on_fatal
        self.request_timeout_s = request_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.send_timeout_s = send_timeout_s
        self.send_hwm = send_hwm
        self.dropped_messages = 0  # frames from the channel that were malformed or not the sender's to send
        self.error: str | None = None  # why no core serves (None: healthy or starting)
        self.restarts = 0
        self._cores: dict[int, _Core] = {}
        self._ready: dict[int, asyncio.Future[m.Ready]] = {}
        self._launched: dict[int, int] = {}  # engine id -> pid of the core process started for it
        self._early: dict[int, m.Ready] = {}  # a Ready that came before its launcher returned
        self._requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._context: zmq.asyncio.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> list[m.Ready]:
        """Open the channel, start every core and wait until each is ready; raises
        :class:`CoreStartupError` if one fails first."""
        self._loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe is EAGAIN, never a silent drop
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.send_hwm is not None:
            self._sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        self._spawn(self._read())
        try:
            return list(await asyncio.gather(*(self._start_core(i) for i in range(self.num_cores))))
        except BaseException:
            await self.stop()
            raise

    async def _start_core(self, engine_id: int) -> m.Ready:
        loop = asyncio.get_running_loop()
        self._ready[engine_id] = ready = loop.create_future()
        self._launched.pop(engine_id, None)
        self._early.pop(engine_id, None)
        folder, address = self._open_endpoint()
        try:
            handle = await asyncio.to_thread(self._launcher, engine_id, address)
            core = self._cores[engine_id] = _Core(handle)
            self._launched[engine_id] = handle.pid
            early = self._early.pop(engine_id, None)
            if early is not None:
                self._offer_ready(early)
            self._spawn(self._watch(engine_id, core))
            try:
                info = await asyncio.wait_for(asyncio.shield(ready), self.ready_timeout_s)
            except asyncio.TimeoutError:
                raise CoreStartupError(
                    f"engine core {engine_id} was not ready after {self.ready_timeout_s:.0f} s"
                ) from None
        finally:  # connected (or failed): no one else may connect
            shutil.rmtree(folder, ignore_errors=True)
        logger.info("engine core %d ready (pid %d): %d KV blocks", engine_id, info.pid, info.num_kv_blocks)
        return info

    def _open_endpoint(self) -> tuple[str, str]:
        """A fresh private folder and an ``ipc://`` endpoint in it, bound; returns both."""
        folder = tempfile.mkdtemp(prefix="deepinfer-")  # mode 0700
        if len(os.path.join(folder, "engine").encode()) > MAX_IPC_PATH:
            shutil.rmtree(folder, ignore_errors=True)
            raise CoreStartupError(
                f"the temporary folder {tempfile.gettempdir()!r} has too long a path for the engine "
                f"channel's socket (at most {MAX_IPC_PATH - len('/deepinfer-XXXXXXXX/engine')} bytes): "
                "set TMPDIR to a shorter one"
            )
        address = f"ipc://{folder}/engine"
        self._sock.bind(address)
        return folder, address

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Shut every core down (abort what is left; kill a core that does not exit in time)."""
        self._stopping = True
        for engine_id, core in self._cores.items():
            if core.alive:
                self._send(engine_id, m.Shutdown())
        for core in self._cores.values():
            if not await asyncio.to_thread(core.handle.join, timeout_s):
                logger.warning(
                    "engine core %d did not exit in %.0f s; killing it", core.handle.engine_id, timeout_s
                )
                core.handle.kill()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._context.term()
            self._sock = None
        self._fail_all(EngineDead("the server is shutting down"), None)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._stopping:
            error = task.exception()
            logger.error("the engine client's %s task failed", task.get_coro().__name__, exc_info=error)
            self.error = f"the engine channel failed: {type(error).__name__}: {error}"
            self._fail_all(EngineDead(self.error), None)
            for core in self._cores.values():
                core.alive = False
            if self._on_fatal is not None:
                self._on_fatal(self.error)

    # ------------------------------------------------------------------ state
    @property
    def info(self) -> m.Ready | None:
        """The first ready core's facts (every core serves the same model)."""
        return next((c.ready for c in self._cores.values() if c.ready is not None), None)

    @property
    def healthy(self) -> bool:
        return not self._stopping and any(c.alive and c.ready is not None for c in self._cores.values())

    def core_pids(self) -> dict[int, int]:
        """engine id -> process id of each live, ready core."""
        return {i: c.ready.pid for i, c in self._cores.items() if c.alive and c.ready is not None}

    @property
    def capacity(self) -> int:
        ready = [c.ready for c in self._cores.values() if c.ready is not None]
        return sum(r.max_num_seqs for r in ready) + self.max_queued_requests

    @property
    def weight_bytes(self) -> int:
        """Bytes of model weights the live, ready cores hold, as stored (each core its own copy or
        its experts' shard: ``deepinfer.worker.memory_profile.weight_memory``)."""
        return sum(c.ready.weight_bytes for c in self._cores.values() if c.alive and c.ready is not None)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def core_stats(self) -> dict[int, m.EngineStats]:
        """engine id (data parallel: the rank) -> that live core's last stats."""
        return {i: c.stats for i, c in self._cores.items() if c.alive}

    @property
    def stats(self) -> m.EngineStats:
        """The live cores' last stats, summed (``kv_store`` and ``expert_tokens_per_step`` are per
        core only: see ``core_stats``)."""
        stats = [c.stats for c in self._cores.values() if c.alive]
        if len(stats) == 1:
            return stats[0]
        total = m.EngineStats()
        for s in stats:
            total = m.EngineStats(
                total.num_running + s.num_running,
                total.num_waiting + s.num_waiting,
                total.num_blocks + s.num_blocks,
                total.num_free_blocks + s.num_free_blocks,
                total.prefix_queries + s.prefix_queries,
                total.prefix_hits + s.prefix_hits,
                m.SpecCounts(*(a + b for a, b in zip(_fields(total.spec), _fields(s.spec)))),
                load=combined_load(total.load, s.load),
            )
        return total

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        detokenize: bool = False,
    ) -> RequestStream:
        """Admit a request to the least-loaded live core. Raises :class:`QueueFull` when every slot
        is taken, :class:`EngineDead` when no core serves."""
        if not self.healthy:
            raise EngineDead(self._unavailable())
        if len(self._requests) >= self.capacity:
            raise QueueFull(f"{len(self._requests)} requests in flight (the limit is {self.capacity})")
        engine_id, core = min(
            ((i, c) for i, c in self._cores.items() if c.alive and c.ready is not None),
            key=lambda item: (item[1].in_flight, item[1].stats.kv_cache_usage),  # DeepSeek's decode rule
        )
        request_id = f"srv-{next(self._ids)}"
        stream = RequestStream(self, request_id)
        now = time.monotonic()
        tracked = _Tracked(
            stream,
            engine_id,
            prompt_token_ids,
            params,
            [self._completion(i, prompt_token_ids, params, detokenize) for i in range(params.n)],
            RequestMetrics(arrival_time=arrival_time if arrival_time is not None else now),
        )
        if self.request_timeout_s is not None:
            tracked.deadline = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + self.request_timeout_s, self._expire, request_id
            )
        self._requests[request_id] = tracked
        core.in_flight += 1
        self._send(engine_id, m.AddRequest(request_id, prompt_token_ids, params.model_dump_json()))
        return stream

    def _completion(
        self, index: int, prompt_token_ids: list[int], params: SamplingParams, detokenize: bool
    ) -> _Completion:
        detok = None
        if detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        wants_logprobs = params.logprobs is not None
        return _Completion(
            index,
            logprobs=[] if wants_logprobs else None,
            detokenizer=detok,
            cumulative_logprob=0.0 if wants_logprobs else None,
        )

    def _release(self, request_id: str) -> None:
        """The consumer is done with a request: abort it in its core unless it already ended."""
        tracked = self._untrack(request_id)
        if tracked is not None and self._cores[tracked.engine_id].alive:
            self._send(tracked.engine_id, m.AbortRequests([request_id]))

    def _untrack(self, request_id: str) -> _Tracked | None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._cores[tracked.engine_id].in_flight -= 1
            if tracked.deadline is not None:
                tracked.deadline.cancel()
        return tracked

    def _expire(self, request_id: str) -> None:
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        self._release(request_id)
        tracked.stream._fail(
            RequestTimedOut(
                f"the request ran longer than the server's request timeout of {self.request_timeout_s:g} s"
            )
        )

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with ``error`` (aborted in their cores); returns how many."""
        return self._fail_all(error, None)

    def _fail_all(self, error: BaseException, engine_id: int | None) -> int:
        ids = [rid for rid, t in self._requests.items() if engine_id is None or t.engine_id == engine_id]
        for rid in ids:
            tracked = self._requests[rid]
            if engine_id is None:
                self._release(rid)
            else:
                self._untrack(rid)  # its core is gone: nothing to abort
            tracked.stream._fail(error)
        return len(ids)

    def _send(self, engine_id: int, message: m.ToCore) -> None:
        """Send ``message`` to a live core, in order and never dropped (see the module docstring):
        at once when its pipe has room, else through its outbox."""
        core = self._cores.get(engine_id)
        if self._sock is None or core is None or not core.alive:
            return  # a dead core's requests failed with it: there is nothing left to tell it
        request_id = message.request_id if isinstance(message, m.AddRequest) else None
        deadline = self._loop.time() + self.send_timeout_s
        item = _Outgoing([m.identity(engine_id), m.encode(message)], request_id, deadline)
        if core.outbox or not self._try_send(engine_id, item):
            core.outbox.append(item)
            if core.sender is None:
                core.sender = self._spawn(self._flush(engine_id, core))

    def _try_send(self, engine_id: int, item: _Outgoing) -> bool:
        """One non-blocking send; False when the core's pipe is full (the message is not sent)."""
        sent = self._sock.send_multipart(item.frames, flags=zmq.NOBLOCK)  # resolves at once
        error = sent.exception()
        if isinstance(error, zmq.Again):
            return False
        if error is not None:  # EHOSTUNREACH: not connected, so gone (its watcher fails its requests)
            logger.warning("engine core %d unreachable: %s", engine_id, error)
            if item.request_id is not None:
                self._fail_request(
                    item.request_id, EngineDead(f"engine core {engine_id} is unreachable: {error}")
                )
        return True

    async def _flush(self, engine_id: int, core: _Core) -> None:
        """Send a core's outbox as its pipe frees up; fail AddRequests still waiting at their deadline."""
        loop = asyncio.get_running_loop()
        wait = SEND_RETRY_S[0]
        try:
            while core.outbox and core.alive and self._sock is not None:
                item = core.outbox[0]
                if item.request_id is not None and loop.time() > item.deadline:
                    core.outbox.popleft()
                    self._fail_request(
                        item.request_id,
                        EngineDead(
                            f"engine core {engine_id} did not take the request within {self.send_timeout_s:g} s "
                            "(its channel stayed full); retry later"
                        ),
                    )
                elif self._try_send(engine_id, item):
                    core.outbox.popleft()
                    wait = SEND_RETRY_S[0]
                else:
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, SEND_RETRY_S[1])
        finally:
            core.sender = None

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """End a request that never reached its core (nothing to abort there)."""
        tracked = self._untrack(request_id)
        if tracked is not None:
            tracked.stream._fail(error)

    def _unavailable(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        if self.error:
            return self.error
        return "the engine core is starting (or restarting); retry shortly"

    # ------------------------------------------------------------------ from the cores
    async def _read(self) -> None:
        """Take the cores' messages as they come. The wait is bounded (``READ_WAKE_MS``) and each
        wake drains the socket without blocking: a readiness edge lost to a signal (SIGTERM starts
        a drain) can then delay messages by that bound, never stall them."""
        shadow = zmq.Socket.shadow(self._sock.underlying)
        while True:
            try:
                await self._sock.poll(READ_WAKE_MS)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EINTR:
                    raise
            while True:
                try:
                    frames = shadow.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._take(frames)

    def _take(self, frames: list[bytes]) -> None:
        """Check one frame against its sender's identity and dispatch it, or drop it."""
        if len(frames) != 2:
            self._drop(f"a frame of {len(frames)} parts (a core sends 1)")
            return
        identity, payload = frames
        try:
            message = m.decode_from_core(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop(f"an undecodable message from {identity[:40]!r}: {exc}")
            return
        if identity != m.identity(message.engine_id) or message.engine_id not in self._ready:
            self._drop(f"a message for engine core {message.engine_id} from {identity[:40]!r}")
            return
        self._dispatch(message)

    def _drop(self, what: str) -> None:
        self.dropped_messages += 1
        if self.dropped_messages <= DROP_LOG_LIMIT:
            logger.warning(
                "engine channel: dropped %s%s",
                what,
                "" if self.dropped_messages < DROP_LOG_LIMIT else " (further drops are only counted)",
            )

    def _dispatch(self, message: m.FromCore) -> None:
        if isinstance(message, m.StepOutputs):
            self._deliver(message)
            return
        if isinstance(message, m.Ready):
            if message.engine_id in self._launched:
                self._offer_ready(message)
            else:  # its launcher has not returned yet (a core in a thread starts at once)
                self._early[message.engine_id] = message
            return
        core = self._cores.get(message.engine_id)
        if core is not None:
            core.failure = message.error
        future = self._ready[message.engine_id]
        if message.during_startup and not future.done():
            future.set_exception(CoreStartupError(message.error))

    def _offer_ready(self, message: m.Ready) -> None:
        """Take a core's Ready if it comes from the process started for that engine id."""
        expected = self._launched[message.engine_id]
        if message.pid != expected:
            self._drop(
                f"a Ready for engine core {message.engine_id} from pid {message.pid} (its core is pid {expected})"
            )
            return
        future = self._ready[message.engine_id]
        if not future.done():
            self._cores[message.engine_id].ready = message
            future.set_result(message)

    def _deliver(self, message: m.StepOutputs) -> None:
        engine_id = message.engine_id
        core = self._cores.get(engine_id)
        if core is None or core.ready is None:
            self._drop(f"outputs from engine core {engine_id} before it was ready")
            return
        core.stats = message.stats
        for request_id in message.accepted:
            tracked = self._owned(engine_id, request_id)
            if tracked is not None:
                tracked.stream._accept()
        for refusal in message.refusals:
            tracked = self._owned(engine_id, refusal.request_id)
            if tracked is not None:
                self._untrack(refusal.request_id)
                error = (
                    RequestRefused(refusal.message, refusal.field)
                    if refusal.invalid
                    else RuntimeError(refusal.message)
                )
                tracked.stream._fail(error)
        now = time.monotonic()
        for delta in message.deltas:
            tracked = self._owned(engine_id, delta.request_id)
            if tracked is None:
                continue  # closed by its consumer; its abort is on the way
            self._apply(tracked, delta, now)
            if delta.finished:
                self._untrack(delta.request_id)
            tracked.stream._put(self._output(delta.request_id, tracked, delta.finished))

    def _owned(self, engine_id: int, request_id: str) -> _Tracked | None:
        """The request ``request_id`` if core ``engine_id`` serves it (a request another core
        serves is not this core's to report on: dropped)."""
        tracked = self._requests.get(request_id)
        if tracked is not None and tracked.engine_id != engine_id:
            self._drop(
                f"engine core {engine_id}'s output for {request_id!r}, a request of core {tracked.engine_id}"
            )
            return None
        return tracked

    def _apply(self, tracked: _Tracked, delta: m.RequestDelta, now: float) -> None:
        metrics = tracked.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = delta.first_scheduled_time
        tracked.num_cached_tokens = max(delta.num_cached_tokens, 0)
        for d in delta.completions:
            c = tracked.completions[d.index]
            if d.new_token_ids and metrics.first_token_time is None:
                metrics.first_token_time = now
            c.token_ids.extend(d.new_token_ids)
            if c.logprobs is not None and d.logprobs is not None:
                for entry in d.logprobs:
                    c.logprobs.append({t: Logprob(lp, rank, self._token_text(t)) for t, lp, rank in entry})
                    c.cumulative_logprob += entry[0][1]
            if c.detokenizer is not None:
                for token in d.new_token_ids:
                    c.detokenizer.add(token)
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                if c.detokenizer is not None:
                    self._settle_text(c, tracked.params)
        if delta.finished:
            metrics.finished_time = now

    @staticmethod
    def _settle_text(c: _Completion, params: SamplingParams) -> None:
        """The final text, as the engine would have made it: cut at the stop string that ended the
        completion (kept with ``include_stop_str_in_output``), else with held-back bytes flushed."""
        detok = c.detokenizer
        if isinstance(c.stop_reason, str):
            at = detok.text.find(c.stop_reason)
            if at >= 0:
                detok.text = detok.text[
                    : at + len(c.stop_reason) if params.include_stop_str_in_output else at
                ]
        else:
            detok.flush()

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def _output(self, request_id: str, tracked: _Tracked, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=c.index,
                    text=c.detokenizer.text if c.detokenizer is not None else "",
                    token_ids=c.token_ids,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=c.logprobs,
                    cumulative_logprob=c.cumulative_logprob,
                )
                for c in tracked.completions
            ],
            finished=finished,
            metrics=tracked.metrics,
            num_cached_tokens=tracked.num_cached_tokens,
        )

    # ------------------------------------------------------------------ supervision
    async def _watch(self, engine_id: int, core: _Core) -> None:
        how = await asyncio.to_thread(core.handle.wait)
        core.alive = False
        if self._stopping:
            return
        await asyncio.sleep(0.1)  # let the reader take a CoreFailed the core sent before it exited
        reason = core.failure or f"the engine core (pid {core.handle.pid}) {how}"
        ready = self._ready.get(engine_id)
        if ready is not None and not ready.done():
            ready.set_exception(
                CoreStartupError(f"engine core {engine_id} {how} before it was ready: {reason}")
            )
            return
        failed = self._fail_all(EngineDead(f"the engine failed: {reason}"), engine_id)
        logger.error("engine core %d died (%s); %d requests failed", engine_id, reason, failed)
        if self.restart:
            self.restarts += 1
            logger.warning("restarting engine core %d (restart %d)", engine_id, self.restarts)
            try:
                await self._start_core(engine_id)
                return
            except Exception as exc:
                reason = f"the engine core could not be restarted: {exc}"
        self.error = f"the engine failed: {reason}"
        if self._on_fatal is not None:
            self._on_fatal(self.error)


def _fields(spec: m.SpecCounts) -> tuple[int, ...]:
    return (
        spec.draft_tokens,
        spec.verified_tokens,
        spec.accepted_tokens,
        spec.emitted_tokens,
        spec.request_steps,
    )
