"""The engine core's loop: one ``LLMEngine`` driven by messages from an API front.

An :class:`EngineCore` connects a ZeroMQ DEALER socket (identity: its ``engine_id``) to the front's
ROUTER, says :class:`~deepinfer.core.messages.Ready`, then loops: take every queued message (adds,
aborts, shutdown), run one engine step while there is work, and send the step's token deltas with
the engine's stats. Idle, it blocks on the socket (no polling) and wakes once a second to check
that its parent (the front) is alive; when the parent is gone, it exits. Its sends block while the
front's pipe is full (backpressure: nothing it sends is dropped).

A request the engine refuses (``ValueError``) or fails to add (any other exception) is answered with
a :class:`~deepinfer.core.messages.Refusal`; the other requests carry on. An exception in a step is
fatal: the core sends :class:`~deepinfer.core.messages.CoreFailed` and raises (the process exits
non-zero; the front fails the requests it had in flight and decides whether to restart a core).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from deepinfer import envs
from deepinfer.core import messages as m
from deepinfer.core.load import CostModel, engine_load, kv_layout_fingerprint, step_cost_model
from deepinfer.core.step_log import StepLog
from deepinfer.logger import get_logger
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.outputs import RequestOutput

logger = get_logger(__name__)

IDLE_WAKE_MS = 1000  # an idle core checks on its parent this often
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "choice")


class EngineCore:
    """Serves ``engine`` to the front listening at ``address`` (see the module docstring).
    ``parent_pid``: exit once this process is no longer our parent (``None``: do not watch)."""

    def __init__(self, engine: LLMEngine, engine_id: int, address: str, parent_pid: int | None) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.address = address
        self.parent_pid = parent_pid
        self._sent: dict[str, list[int]] = {}  # request id -> tokens sent, per completion
        self._ended: dict[str, list[bool]] = {}  # request id -> finish sent, per completion
        self._unscheduled: dict[str, None] = {}  # admitted, not yet scheduled (ordered set)
        self._scheduled_at: dict[str, float] = {}
        self._busy_s = 0.0  # time in engine steps since start (reported to routers)
        self._sent_store: dict | None = None  # the KV store counters last sent to the front
        log_dir = envs.get("DEEPINFER_STEP_LOG_DIR")
        self._step_log = StepLog(Path(log_dir), engine_id) if log_dir else None

    def serve(self) -> None:
        """Run until told to shut down or orphaned; raises after a fatal engine error."""
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, m.identity(self.engine_id))
        sock.setsockopt(zmq.LINGER, 2000)  # a failure report still leaves when we exit right after
        sock.connect(self.address)
        try:
            sock.send(m.encode(self._ready()))
            self._loop(sock)
        except Exception as exc:
            logger.exception("engine core %d failed; it stops", self.engine_id)
            with contextlib.suppress(zmq.ZMQError):
                sock.send(m.encode(m.CoreFailed(self.engine_id, f"{type(exc).__name__}: {exc}", False)))
            raise
        finally:
            self.engine.close()  # the KV store's last writes reach their files before the core exits
            sock.close()
            context.term()
            if self._step_log is not None:
                self._step_log.close()

    def _ready(self) -> m.Ready:
        e = self.engine
        return m.Ready(
            engine_id=self.engine_id,
            pid=os.getpid(),
            model=str(e.config.model),
            max_model_len=e.max_model_len,
            max_num_seqs=e.config.max_num_seqs,
            vocab_size=e.model_config.vocab_size,
            num_kv_blocks=e.kv_cache.pool.num_blocks,
            block_size=e.cache_spec.block_size,
            description=f"{e.platform.describe()}, {str(e.dtype).removeprefix('torch.')}, {e.weights_summary}",
            node_role=e.platform.node_role.value,
            kv_layout=kv_layout_fingerprint(e),
            cost_model=CostModel.of(step_cost_model(e)),
            kv_store_namespace=e.kv_connector.ns_digest.hex() if e.kv_connector else "",
            kv_shared_path=(e.kv_connector.config.shared_path or "") if e.kv_connector else "",
            weight_bytes=e.weight_memory.total_bytes,
        )

    # ------------------------------------------------------------------ the loop
    def _loop(self, sock: zmq.Socket) -> None:
        engine = self.engine
        # None: until a message; a KV store writes behind after the last step, so its core wakes to report it
        idle_wait = IDLE_WAKE_MS if self.parent_pid is not None or engine.kv_connector else None
        while True:
            busy = engine.has_unfinished_requests()
            if not sock.poll(0 if busy else idle_wait):
                if not busy and self._orphaned():
                    logger.warning(
                        "engine core %d: the front (pid %s) is gone; exiting", self.engine_id, self.parent_pid
                    )
                    return
                if not busy:
                    if engine.kv_connector is not None and engine.kv_store_stats() != self._sent_store:
                        sock.send(m.encode(m.StepOutputs(self.engine_id, [], [], [], self._stats())))
                    continue
            commands = []
            while sock.poll(0):
                commands.append(m.decode_to_core(sock.recv()))
            accepted, refusals, stop = self._apply(commands)
            if stop:
                engine.abort_request(list(self._sent))
                return
            if accepted or refusals:  # answer the waiting handlers before the (maybe long) step
                sock.send(m.encode(m.StepOutputs(self.engine_id, accepted, refusals, [], self._stats())))
            if engine.has_unfinished_requests():
                deltas = self._step()
                sock.send(m.encode(m.StepOutputs(self.engine_id, [], [], deltas, self._stats())))
            elif commands:
                sock.send(m.encode(m.StepOutputs(self.engine_id, [], [], [], self._stats())))

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _apply(self, commands: list[m.ToCore]) -> tuple[list[str], list[m.Refusal], bool]:
        """Apply queued commands: returns the requests taken, those refused, and whether to stop."""
        accepted, refusals = [], []
        for command in commands:
            if isinstance(command, m.Shutdown):
                return accepted, refusals, True
            if isinstance(command, m.AbortRequests):
                self.engine.abort_request(command.request_ids)
                for rid in command.request_ids:
                    self._forget(rid)
                continue
            refusal = self._add(command)
            if refusal is None:
                accepted.append(command.request_id)
            else:
                refusals.append(refusal)
        return accepted, refusals, False

    def _add(self, command: m.AddRequest) -> m.Refusal | None:
        rid = command.request_id
        params = None
        try:
            params = SamplingParams.model_validate_json(command.params_json)
            self.engine.add_request(rid, None, command.prompt_token_ids, params)
        except ValueError as exc:
            return m.Refusal(rid, str(exc), _constraint_field(params, exc), True)
        except Exception as exc:  # a bug on this request's path must not take the others down
            logger.exception("engine core %d: adding request %s failed", self.engine_id, rid)
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)  # undo whatever part of the add happened
            return m.Refusal(rid, f"{type(exc).__name__}: {exc}", None, False)
        n = params.n
        self._sent[rid] = [0] * n
        self._ended[rid] = [False] * n
        self._unscheduled[rid] = None
        if self._step_log is not None:
            self._step_log.added(rid, time.monotonic(), len(command.prompt_token_ids))
        return None

    def _forget(self, rid: str) -> None:
        self._sent.pop(rid, None)
        self._ended.pop(rid, None)
        self._unscheduled.pop(rid, None)
        self._scheduled_at.pop(rid, None)

    def _step(self) -> list[m.RequestDelta]:
        started = time.monotonic()
        before = self.engine.last_step
        outputs = self.engine.step()
        ended = time.monotonic()
        self._busy_s += ended - started
        # A step that scheduled nothing (a KV load pending, or the last requests just finished) ran
        # no batch: not logged, else it would repeat the step before it.
        if self._step_log is None or self.engine.last_step is before:
            return self._deltas(outputs, started)
        unstarted = {rid for rid, sent in self._sent.items() if not any(sent)}
        deltas = self._deltas(outputs, started)
        self._log_step(started, ended, unstarted, deltas)
        return deltas

    def _log_step(self, t0: float, t1: float, unstarted: set[str], deltas: list[m.RequestDelta]) -> None:
        """One step's line in the step log: its composition, times, and first tokens."""
        scheduled, forward_s = self.engine.last_step or (None, 0.0)
        requests = scheduled.requests if scheduled is not None else []
        first = [
            d.request_id
            for d in deltas
            if d.request_id in unstarted and any(c.new_token_ids for c in d.completions)
        ]
        parent_of = self.engine.outputs.parent_of
        self._step_log.step(
            t0, t1, forward_s, [(r.num_new_tokens, r.num_computed_tokens) for r in requests],
            [parent_of.get(r.request_id, r.request_id) for r in requests], first,
        )  # fmt: skip

    def _deltas(self, outputs: list[RequestOutput], started: float) -> list[m.RequestDelta]:
        """The token deltas of a step's outputs (``started``: when the step began)."""
        engine = self.engine
        if self._unscheduled:
            parent_of = engine.outputs.parent_of
            for request in engine.scheduler.running:
                parent = parent_of.get(request.request_id)
                if parent in self._unscheduled:
                    del self._unscheduled[parent]
                    self._scheduled_at[parent] = started
        return [self._delta(out, started) for out in outputs if out.request_id in self._sent]

    def _delta(self, out: RequestOutput, step_started: float) -> m.RequestDelta:
        rid = out.request_id
        if rid in self._unscheduled:  # finished within its first step, so never seen running
            del self._unscheduled[rid]
            self._scheduled_at[rid] = step_started
        sent, ended = self._sent[rid], self._ended[rid]
        completions = []
        for c in out.outputs:
            i = c.index
            new = c.token_ids[sent[i] :]
            if not new and (ended[i] or c.finish_reason is None):
                continue
            logprobs = None
            if c.logprobs is not None:
                logprobs = [
                    [(t, lp.logprob, lp.rank) for t, lp in entry.items()] for entry in c.logprobs[sent[i] :]
                ]
            sent[i] = len(c.token_ids)
            ended[i] = c.finish_reason is not None
            completions.append(m.CompletionDelta(i, new, c.finish_reason, c.stop_reason, logprobs))
        scheduled = self._scheduled_at.get(rid)
        delta = m.RequestDelta(rid, completions, out.finished, out.num_cached_tokens, scheduled)
        if out.finished:
            self._forget(rid)
        return delta

    def _stats(self) -> m.EngineStats:
        e = self.engine
        kv, spec = e.kv_cache, e.spec_stats
        return m.EngineStats(
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            num_blocks=kv.pool.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            spec=m.SpecCounts(
                spec.draft_tokens,
                spec.verified_tokens,
                spec.accepted_tokens,
                spec.emitted_tokens,
                spec.request_steps,
            ),
            kv_store=self._record_store_stats(),
            load=engine_load(e, self._busy_s),
        )

    def _record_store_stats(self) -> dict | None:
        """The KV store's counters, remembered as the last sent (an idle core sends them again
        when the write-behind has moved them on)."""
        self._sent_store = self.engine.kv_store_stats()
        return self._sent_store


def _constraint_field(params: SamplingParams | None, exc: ValueError) -> str | None:
    """The output-constraint field a refusal is about (a grammar that does not compile)."""
    from deepinfer.structured.backend import GrammarError

    if params is None or not isinstance(exc, GrammarError):
        return None
    return next((name for name in CONSTRAINT_FIELDS if getattr(params, name) is not None), None)
