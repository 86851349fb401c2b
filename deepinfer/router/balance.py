"""Balance of a routed run against a perfect schedule.

``balance = perfect makespan / achieved makespan``. Achieved: the busiest worker's busy time (engine
step time during the run). Perfect: the same jobs placed offline with full knowledge by
longest-processing-time first (LPT, within 4/3 of the optimum; with many jobs close to it) on as many
workers. Job durations are not separable on a batching engine, so each job's size is its predicted
cost (the workers' cost model), scaled so that the sizes add up to the measured total busy time:
the perfect schedule does the same total work, only placed better. 1.0 is perfect; DeepSeek report
about 0.8 for their prefill router.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def lpt_makespan(job_sizes: Sequence[float], num_workers: int) -> float:
    """Makespan of longest-processing-time-first list scheduling of ``job_sizes`` on ``num_workers``."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if any(s < 0 for s in job_sizes):
        raise ValueError("job sizes must be >= 0")
    loads = [0.0] * num_workers
    for size in sorted(job_sizes, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + size)
    return max(loads)


@dataclass(frozen=True, slots=True)
class Balance:
    """Per-worker busy seconds during a run, the makespans and their ratio."""

    busy_s: dict[str, float]
    achieved_makespan_s: float
    perfect_makespan_s: float
    balance: float

    def as_dict(self) -> dict:
        return {
            "busy_s": self.busy_s,
            "achieved_makespan_s": self.achieved_makespan_s,
            "perfect_makespan_s": self.perfect_makespan_s,
            "balance": self.balance,
        }


def balance(busy_s: Mapping[str, float], job_costs: Sequence[float]) -> Balance:
    """Balance of a run whose workers were busy ``busy_s`` (worker -> seconds) serving jobs of
    predicted costs ``job_costs`` (any unit: only their proportions are used)."""
    if not busy_s:
        raise ValueError("balance needs at least one worker")
    total, predicted = sum(busy_s.values()), sum(job_costs)
    achieved = max(busy_s.values())
    if total <= 0 or predicted <= 0:
        raise ValueError("balance needs busy time and jobs of positive predicted cost")
    perfect = lpt_makespan([c * total / predicted for c in job_costs], len(busy_s))
    return Balance(dict(busy_s), achieved, perfect, perfect / achieved)


def request_cost(model, prompt_tokens: int, output_tokens: int) -> float:
    """Predicted compute of one request under a ``StepCostModel``: its prompt, then each output
    token after a growing context (the marginal cost in a batch)."""
    decode = sum(model.marginal(1, prompt_tokens + i) for i in range(max(0, output_tokens - 1)))
    return model.marginal(prompt_tokens, 0) + decode
