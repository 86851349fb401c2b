"""The token-budget scheduler (pure Python; testable without a device).

There is no prefill phase and no decode phase. Each request has ``num_tokens`` tokens (prompt plus
generated) of which ``num_computed_tokens`` have KV in the cache; every step the scheduler gives each
request some number of new tokens to compute so that it catches up. A decode is a request one token
behind; a prompt is a request many tokens behind, computed in chunks when the step's token budget is
short; both share one batch. Running requests are served first, in arrival order; when blocks run out
the most recently arrived running request is preempted (its blocks freed, its tokens recomputed
later). Waiting requests are admitted in arrival order while budget, sequence slots and blocks last,
starting from their longest cached prefix.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sched_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.engine.kv_connector import StoreConnector


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int  # largest chunk one request gets in one step
    step_time_budget_s: float | None = None  # cut prompt chunks to this predicted step time (None: off)
    num_lookahead_tokens: int = 0  # speculative decoding: draft tokens per request per step
    max_decode_steps: int = 1  # decode iterations one step may run back to back (see Scheduler._decode_steps)

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "long_prefill_token_threshold",
            "max_decode_steps",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        cost_model: StepCostModel | None = None,
        connector: StoreConnector | None = None,
    ) -> None:
        if config.step_time_budget_s is not None and cost_model is None:
            raise ValueError("a step time budget needs a cost model")
        self.config = config
        self.kv = kv_cache
        self.cost_model = cost_model
        # Measured / predicted time of recent steps that held a prompt chunk (see observe_step_time).
        self.time_ratios: deque[float] = deque(maxlen=self.FEEDBACK_WINDOW)
        self.time_scale = 1.0
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Seconds of one decode iteration and the batch size it was measured at (observe_step_time).
        self.decode_iteration: tuple[float, int] | None = None
        self.connector = connector  # the KV store (deepinfer/kvstore): loads at admission, saves blocks

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError for a duplicate id or one that can never fit the cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError when a request of this many prompt and new tokens could never be held by
        the whole KV cache (with its draft slots): admitted, it would wait for blocks forever."""
        bs = self.kv.block_size
        num_blocks = self.kv.pool.num_blocks
        lookahead = self.config.num_lookahead_tokens
        if -(-(num_prompt_tokens + max_tokens + lookahead) // bs) > num_blocks:
            drafts = f", {lookahead} per request kept for drafts" if lookahead else ""
            raise ValueError(
                f"the prompt's {num_prompt_tokens} tokens plus max_tokens={max_tokens} do not fit the KV "
                f"cache, {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens{drafts}); lower "
                "max_tokens or shorten the prompt"
            )

    def has_unfinished(self) -> bool:
        return bool(
            self.waiting or self.running or (self.connector is not None and self.connector.num_loading)
        )

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, reason: str | None = None
    ) -> None:
        """Finish (stop or abort) requests wherever they are; frees their blocks. Unknown ids are
        ignored (the request may have finished on its own meanwhile)."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif self.connector is None or not self.connector.is_loading(request):
                self.waiting.remove(request)
            self._finish(request, status, reason)

    def _finish(self, request: Request, status: RequestStatus, reason: int | str | None) -> None:
        request.status = status
        request.stop_reason = reason
        if self.connector is not None:
            self.connector.cancel(request)
        self.kv.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        step = _StepBudget(self.config, self.cost_model, self.time_scale)
        picked: list[tuple[Request, int, list[int]]] = []  # request, real tokens, drafts
        preempted: list[str] = []
        lookahead = self.config.num_lookahead_tokens
        steps = self._decode_steps()

        index = 0
        while index < len(self.running) and step.tokens > 0:
            request = self.running[index]
            if request.num_output_tokens + request.num_pending_tokens >= request.max_tokens:
                index += 1  # its last token is still in flight (async scheduling)
                continue
            num_new = step.chunk(
                request.num_tokens_with_pending - request.num_computed_tokens, request.num_computed_tokens
            )
            if num_new == 0:
                index += 1  # a prompt chunk that does not fit the time left; decodes behind it still run
                continue
            drafts = self._drafts(request, step.tokens - num_new) if num_new == 1 else []
            while not self.kv.allocate(request, num_new + len(drafts), lookahead=max(lookahead, steps - 1)):
                if steps > 1:  # no room for the iterations ahead: one this step (earlier grants are kept)
                    steps = 1
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                picked.append((request, num_new, drafts))
                step.take(num_new + len(drafts), request.num_computed_tokens)
                index += 1

        if self.connector is not None:  # KV store loads that completed: admit those requests first
            self.waiting.extendleft(reversed(self.connector.poll()))
        if not preempted:
            while self.waiting and step.tokens > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                cached = self.kv.find_cached_prefix(request)
                # KV store: a request whose further blocks are stored waits while they load, and
                # (sliding-window models) replays the tokens whose window state the hit lacks.
                if self.connector is not None and self.connector.begin_load(request, cached):
                    self.waiting.popleft()
                    continue
                num_cached = len(cached) * self.kv.block_size
                start = num_cached - (self.connector.replay_tokens(request, cached) if self.connector else 0)
                num_new = step.chunk(request.num_tokens - start, start)
                if num_new == 0 or not self.kv.allocate(
                    request, max(0, start + num_new - num_cached), cached, lookahead=lookahead
                ):
                    break
                self.waiting.popleft()
                self.kv.record_prefix_lookup(request, num_cached)
                request.num_computed_tokens = start
                request.kv_write_floor = num_cached if start < num_cached else 0
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = start
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                picked.append((request, num_new, []))
                step.take(num_new, start)

        scheduled = []
        kv_saves = []
        for request, num_new, drafts in picked:
            start = request.num_computed_tokens
            token_ids = request.all_token_ids[start : start + num_new]
            token_ids += [PLACEHOLDER] * (num_new - len(token_ids))
            samples = start + num_new == request.num_tokens_with_pending
            token_ids += drafts
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=token_ids,
                    num_computed_tokens=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    samples=samples,
                    sampling_params=request.sampling_params,
                    seed=request.seed,
                    num_prompt_tokens=request.num_prompt_tokens,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    num_draft_tokens=len(drafts),
                    write_floor=request.kv_write_floor,
                )
            )
            if self.connector is not None:
                kv_saves += self.connector.saves(request, start + num_new, scheduled[-1].block_ids)
            request.num_computed_tokens = start + num_new + len(drafts) + steps - 1
            request.num_pending_tokens += samples
        return SchedulerOutput(scheduled, preempted, kv_saves, decode_steps=steps)

    # A multi-iteration decode step is cut to about this long: the longest a request arriving meanwhile
    # waits to be admitted, and the longest gap in a stream of tokens that its iterations cause.
    DECODE_STEPS_WINDOW_S = 0.004

    def _decode_steps(self) -> int:
        """How many decode iterations this step runs back to back (1: the usual single forward).

        At small batches a decode step is mostly host work around one short forward: scheduling,
        input building, output processing. Where every running request is a plain decode, none waits
        and no feature needs the host between tokens, the runner instead repeats the forward and
        sampling ``k`` times, feeding each sampled token back in (see ``ModelRunner.execute``); the
        scheduler reserves the ``k - 1`` further KV slots and the tokens come back together, the stop
        rules applied to each in turn as for accepted drafts. Off (1) with speculative decoding, a KV
        store, a step in flight (async scheduling), a structured-output request, and until one decode
        iteration has been timed; ``k`` is then at most ``max_decode_steps``, what fits the
        ``DECODE_STEPS_WINDOW_S`` window (the measured iteration scaled up linearly to a larger
        batch), and every request's remaining ``max_tokens``.
        """
        limit = self.config.max_decode_steps
        if (
            limit == 1
            or self.config.num_lookahead_tokens
            or self.connector is not None
            or self.waiting
            or not self.running
            or self.decode_iteration is None
        ):
            return 1
        for r in self.running:
            if (
                r.num_pending_tokens
                or r.num_tokens - r.num_computed_tokens != 1
                or r.sampling_params.constrained
            ):
                return 1
            limit = min(limit, r.max_tokens - r.num_output_tokens)
        seconds, batch = self.decode_iteration
        per_iteration = seconds * max(1.0, len(self.running) / batch)
        return max(1, min(limit, int(self.DECODE_STEPS_WINDOW_S / max(per_iteration, 1e-9))))

    FEEDBACK_WINDOW = 64  # recent chunked steps whose measured / predicted times set the scale
    FEEDBACK_QUANTILE = 0.9

    def observe_step_time(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Feed back the measured time of an executed step.

        With a time budget, chunks are sized so that the predicted time times a scale meets the
        budget; the scale is the 90th percentile of measured / predicted over recent steps that held a
        prompt chunk (the only steps the budget shapes). That corrects the calibration where it is off
        (shapes it did not sample, contention, clock changes) and makes the budget one on the tail:
        the same step's time varies by ~30% at p99 on a busy host, so aiming the mean at the budget
        would overrun it every few steps. Ratios are clamped to [0.5, 3].
        """
        if scheduled.requests and all(r.num_new_tokens == 1 for r in scheduled.requests):
            self.decode_iteration = (seconds / scheduled.decode_steps, len(scheduled.requests))
        if self.config.step_time_budget_s is None or all(r.num_new_tokens == 1 for r in scheduled.requests):
            return
        work = [(r.num_new_tokens, r.num_computed_tokens) for r in scheduled.requests]
        self.time_ratios.append(min(max(seconds / self.cost_model.predict(work), 0.5), 3.0))
        ordered = sorted(self.time_ratios)
        self.time_scale = ordered[min(len(ordered) - 1, int(self.FEEDBACK_QUANTILE * len(ordered)))]

    def _drafts(self, request: Request, room: int) -> list[int]:
        """The request's pending drafts that fit: the step's token budget, max_tokens (the step emits
        up to drafts + 1 tokens) and the context length."""
        limit = min(
            room,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens,
        )
        return request.spec_token_ids[: max(0, limit)]

    def _preempt(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.cancel(request)
        self.kv.free(request)
        request.kv_write_floor = 0
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a token in flight is still appended when it arrives
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Apply a step's results: roll back rejected drafts, append each emitted token with the
        token-level stop rules (EOS, stop token ids, max_tokens; tokens after a stop are dropped), and
        keep the next drafts. Returns the requests that received tokens (finished ones included)."""
        updated = []
        for scheduled in output.requests:
            tokens = sampled.get(scheduled.request_id)
            request = self.requests.get(scheduled.request_id)
            if tokens is None or request is None:
                continue
            request.num_pending_tokens = max(0, request.num_pending_tokens - 1)
            # Positions computed ahead (drafts, further decode iterations) whose tokens were not emitted.
            ahead = scheduled.num_draft_tokens + output.decode_steps - 1
            request.num_computed_tokens -= ahead - (len(tokens) - 1)
            updated.append(request)
            for token in tokens:
                request.append_output_token(token)
                if self._check_stop(request, token):
                    break
            else:
                request.spec_token_ids = (drafts or {}).get(request.request_id, [])
        return updated

    def _check_stop(self, request: Request, token: int) -> bool:
        reason = request.sampling_params.stop_reason(token, request.eos_token_ids, request.num_output_tokens)
        if reason == "eos":
            self._stop_running(request, RequestStatus.FINISHED_STOPPED, None)
        elif reason == "stop_token":
            self._stop_running(request, RequestStatus.FINISHED_STOPPED, token)
        elif request.num_output_tokens >= request.max_tokens:
            self._stop_running(request, RequestStatus.FINISHED_LENGTH, None)
        else:
            return False
        return True

    def _stop_running(self, request: Request, status: RequestStatus, reason: int | None) -> None:
        self.running.remove(request)
        self._finish(request, status, reason)


class _StepBudget:
    """What is left of one step: tokens, and (with a time budget) predicted seconds.

    A request one token behind (a decode) always gets its token: decodes must progress. A prompt
    chunk gets as many tokens as fit the token budget, the per-request chunk cap and, with a time
    budget, the predicted time left; when nothing fits and the step is still empty it gets one block's
    worth, so a long prompt always progresses.
    """

    MIN_CHUNK = 16

    def __init__(
        self, config: SchedulerConfig, cost_model: StepCostModel | None, time_scale: float = 1.0
    ) -> None:
        self.tokens = config.max_num_batched_tokens
        self.cap = config.long_prefill_token_threshold
        self.cost = cost_model if config.step_time_budget_s is not None else None
        # Predicted seconds left, in the model's units: measured time ~ time_scale * predicted.
        budget = (config.step_time_budget_s or 0.0) / time_scale
        self.seconds = budget - (self.cost.overhead_s if self.cost else 0.0)
        self.empty = True

    def chunk(self, remaining: int, num_cached: int) -> int:
        limit = min(remaining, self.tokens, self.cap)
        if self.cost is None or remaining == 1:
            return limit
        fits = self.cost.largest_chunk(num_cached, self.seconds, limit)
        return fits if fits > 0 or not self.empty else min(limit, self.MIN_CHUNK)

    def take(self, num_new: int, num_cached: int) -> None:
        self.tokens -= num_new
        self.empty = False
        if self.cost is not None:
            self.seconds -= self.cost.marginal(num_new, num_cached)
