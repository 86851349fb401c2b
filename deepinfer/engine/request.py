"""A request as the engine tracks it: tokens, progress, status, cache bookkeeping.

Created by ``LLMEngine.add_request`` (one per completion; ``n > 1`` makes n of them), mutated by the
scheduler (``num_computed_tokens``, status, appended tokens) and read by the output processor. Host
data only. There is no prefill or decode phase: a request simply has ``num_tokens`` tokens of which
``num_computed_tokens`` already have KV in the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    max_tokens: int  # resolved against the context length
    eos_token_ids: frozenset[int]
    arrival_time: float
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = (
        0  # tokens sampled by a step still in flight (async scheduling), not yet appended
    )
    num_cached_tokens: int = -1  # prefix-cache hits at first scheduling; -1 before
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    kv_write_floor: int = 0  # SWA replay after a KV-store hit: full-attention layers keep rows below it

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the scheduler plans with: known tokens plus those a step in flight will sample."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
