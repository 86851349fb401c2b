"""Turns engine progress into ``RequestOutput``s: detokenization, stop strings, log-probabilities,
and the grouping of ``n`` completions under one request.

Owned by the LLMEngine; host data only. Stop strings are found here (they need text); the engine then
finishes the request in the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.request import Request
from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer
from deepinfer.worker.sampler import to_logprob_dict


@dataclass(slots=True)
class CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_recorded: int = 0  # output tokens already detokenized


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    children: dict[str, int] = field(default_factory=dict)  # child request id -> completion index


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize  # False: text only where stop strings need it; logprobs undecoded
        self.states: dict[str, RequestState] = {}
        self.parent_of: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        now = time.monotonic()
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=children[0].prompt_token_ids,
            params=params,
            completions=[],
            metrics=RequestMetrics(arrival_time=now),
            prompt_logprobs=[None] + [None] * (len(children[0].prompt_token_ids) - 1)
            if params.prompt_logprobs is not None
            else None,
        )
        for index, child in enumerate(children):
            detok = (
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params.skip_special_tokens)
                if self.tokenizer is not None and (self.detokenize or params.stop)
                else None
            )
            state.completions.append(
                CompletionState(
                    index,
                    detok,
                    child.output_token_ids,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
            state.children[child.request_id] = index
            self.parent_of[child.request_id] = request_id
        self.states[request_id] = state

    def discard(self, request_id: str) -> None:
        """Forget a request without an output (it was never queued); unknown ids are ignored."""
        state = self.states.pop(request_id, None)
        if state is not None:
            for child in state.children:
                self.parent_of.pop(child, None)

    def _decode_token(self, token: int) -> str:
        if self.tokenizer is None or not self.detokenize:
            return ""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def record_prompt_logprobs(
        self, child_id: str, entries: list[tuple[int, list[tuple[int, float, int]]]]
    ) -> None:
        state = self.states[self.parent_of[child_id]]
        if state.prompt_logprobs is None or state.children[child_id] != 0:
            return
        for position, entry in entries:
            state.prompt_logprobs[position] = to_logprob_dict(entry, self._decode_token)

    def record_tokens(
        self, request: Request, logprobs: list[list[tuple[int, float, int]]] | None
    ) -> str | None:
        """Account for the request's tokens appended since the last call (several with speculative
        decoding; ``logprobs`` has one entry list per token). Returns the stop string they completed,
        if any: the text and the token ids are then cut there and the caller must finish the request."""
        state = self.states[self.parent_of[request.request_id]]
        completion = state.completions[state.children[request.request_id]]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
            state.num_cached_tokens = max(request.num_cached_tokens, 0)
        new = request.output_token_ids[completion.num_recorded :]
        for i, token in enumerate(new):
            completion.num_recorded += 1
            if logprobs is not None and completion.logprobs is not None:
                completion.logprobs.append(to_logprob_dict(logprobs[i], self._decode_token))
                completion.cumulative_logprob += logprobs[i][0][1]
            stop = self._add_text(completion, state.params, token)
            if stop is not None:
                del request.output_token_ids[completion.num_recorded :]
                del request.all_token_ids[request.num_prompt_tokens + completion.num_recorded :]
                return stop
        return None

    @staticmethod
    def _add_text(completion: CompletionState, params: SamplingParams, token: int) -> str | None:
        detok = completion.detokenizer
        if detok is None:
            return None
        before = len(detok.text)
        delta = detok.add(token)
        if not delta or not params.stop:
            return None
        search_from = max(0, before - max(len(s) for s in params.stop) + 1)
        for stop in params.stop:
            at = detok.text.find(stop, search_from)
            if at >= 0:
                detok.text = detok.text[: at + len(stop) if params.include_stop_str_in_output else at]
                return stop
        return None

    def finish(self, request: Request) -> None:
        state = self.states[self.parent_of[request.request_id]]
        completion = state.completions[state.children[request.request_id]]
        if completion.finish_reason is not None:
            return
        completion.finish_reason = request.status.value
        completion.stop_reason = request.stop_reason
        if completion.detokenizer is not None and not isinstance(request.stop_reason, str):
            completion.detokenizer.flush()

    def output(self, request_id: str) -> RequestOutput:
        """The cumulative output of a (parent) request; releases its state once every completion ended."""
        state = self.states[request_id]
        finished = all(c.finish_reason is not None for c in state.completions)
        if finished and state.metrics.finished_time is None:
            state.metrics.finished_time = time.monotonic()
        outputs = [
            CompletionOutput(
                index=c.index,
                text=c.detokenizer.text if c.detokenizer is not None else "",
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                cumulative_logprob=c.cumulative_logprob,
            )
            for c in state.completions
        ]
        if finished:
            del self.states[request_id]
            for child in state.children:
                del self.parent_of[child]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )
