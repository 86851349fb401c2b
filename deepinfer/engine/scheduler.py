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

from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sched_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int  # largest chunk one request gets in one step

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "long_prefill_token_threshold",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
            else:
                self.waiting.remove(request)
            self._finish(request, status, reason)

    def _finish(self, request: Request, status: RequestStatus, reason: int | str | None) -> None:
        request.status = status
        request.stop_reason = reason
        self.kv.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunk = self.config.long_prefill_token_threshold
        picked: list[tuple[Request, int]] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, chunk)
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                picked.append((request, num_new))
                budget -= num_new
                index += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                cached = self.kv.find_cached_prefix(request)
                num_cached = len(cached) * self.kv.block_size
                num_new = min(request.num_tokens - num_cached, budget, chunk)
                if not self.kv.allocate(request, num_new, cached):
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_cached
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                picked.append((request, num_new))
                budget -= num_new

        scheduled = []
        for request, num_new in picked:
            start = request.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    num_computed_tokens=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    samples=start + num_new == request.num_tokens,
                    sampling_params=request.sampling_params,
                    seed=request.seed,
                    num_prompt_tokens=request.num_prompt_tokens,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                )
            )
            request.num_computed_tokens = start + num_new
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ results
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append each sampled token and apply the token-level stop rules (EOS, stop token ids,
        max_tokens). Returns the requests that received a token (finished ones included)."""
        updated = []
        for scheduled in output.requests:
            token = sampled.get(scheduled.request_id)
            request = self.requests.get(scheduled.request_id)
            if token is None or request is None:
                continue
            request.append_output_token(token)
            updated.append(request)
            params = request.sampling_params
            may_stop = request.num_output_tokens >= params.min_tokens
            if may_stop and token in request.eos_token_ids and not params.ignore_eos:
                self._stop_running(request, RequestStatus.FINISHED_STOPPED, None)
            elif may_stop and token in params.stop_token_ids:
                self._stop_running(request, RequestStatus.FINISHED_STOPPED, token)
            elif request.num_output_tokens >= request.max_tokens:
                self._stop_running(request, RequestStatus.FINISHED_LENGTH, None)
        return updated

    def _stop_running(self, request: Request, status: RequestStatus, reason: int | None) -> None:
        self.running.remove(request)
        self._finish(request, status, reason)
