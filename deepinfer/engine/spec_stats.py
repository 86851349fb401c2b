"""Honest speculative-decoding accounting: what was drafted, verified, accepted and emitted.

Updated by the engine after every step from the model runner's counts; read by benchmarks and the
server's metrics. ``mean_accepted_len`` is tokens emitted per request per step (accepted drafts plus
the one sampled token; 1.0 without speculation), measured, not assumed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class SpecDecodeStats:
    draft_tokens: int = 0  # proposed by the drafter
    verified_tokens: int = 0  # checked against the target model
    accepted_tokens: int = 0  # verified drafts that were kept
    emitted_tokens: int = 0  # tokens appended (accepted drafts + sampled tokens)
    request_steps: int = 0  # (request, step) pairs that emitted tokens

    def record(self, result) -> None:
        """Add one step's counts (``result``: a RunnerOutput)."""
        self.draft_tokens += result.num_proposed
        self.verified_tokens += result.num_verified
        self.accepted_tokens += result.num_accepted
        self.request_steps += len(result.sampled)
        self.emitted_tokens += sum(len(t) for t in result.sampled.values())

    @property
    def mean_accepted_len(self) -> float:
        return self.emitted_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_accepted_len": self.mean_accepted_len,
            "acceptance_rate": self.acceptance_rate,
        }
