"""The scheduler's decision for one step: the contract between the scheduler and the model runner.

Created by ``Scheduler.schedule``, consumed by ``ModelRunner.execute``. Plain host data: token ids,
positions and block ids, never tensors. ``num_computed_tokens`` is the value BEFORE this step (the
position of ``token_ids[0]``); the scheduler has already advanced the request past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams

PLACEHOLDER = -1  # a token id a step in flight will sample; the engine fills it in before execution


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes (PLACEHOLDER until known, async only)
    num_computed_tokens: int  # tokens already in the cache before this step
    block_ids: list[int]  # every block of the request, in order
    samples: bool  # True when this step reaches the request's last token, so a token is sampled
    sampling_params: SamplingParams
    seed: int
    num_prompt_tokens: int
    prompt_token_ids: list[int]  # read for repetition penalties and prompt logprobs
    output_token_ids: list[int]  # read for penalties; also the sampling offset (its length)
    num_draft_tokens: int = 0  # the last this-many of token_ids are speculative drafts to verify
    write_floor: int = 0  # full-attention layers write no KV below this position (SWA replay, kvstore)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    # KV store: (key, device block id, traffic class) of blocks complete after this step, to save
    kv_saves: list[tuple[bytes, int, str]] = field(default_factory=list)
    # Decode iterations the runner runs back to back (> 1 only when every request is a decode with one
    # token): each request's KV slots for the further iterations are allocated; it emits this many tokens.
    decode_steps: int = 1

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the step computes, over all its decode iterations."""
        return sum(len(r.token_ids) for r in self.requests) + (self.decode_steps - 1) * len(self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
