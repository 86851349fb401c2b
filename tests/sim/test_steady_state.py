"""``arrivals(..., steady_state=True)``: a trace that starts with the sessions a steady state has in
progress, so a class with several turns a session has its full request rate from time 0 (issue 34,
defect 20: the planner's peak-hour window held only first turns, a fraction of the peak load)."""

from __future__ import annotations

import math
import statistics

import pytest

from deepinfer.sim.cachesim import run_cache_stage
from deepinfer.sim.policies import TierRetention, retention_policy
from deepinfer.sim.tiers import Tier, TieredStore
from deepinfer.sim.workload import LengthDist, WorkloadSpec, arrivals
from tests.sim.test_cache_stage import KV, revisiting
from tests.sim.test_planner import small


def spec(turns: float, gap: LengthDist) -> WorkloadSpec:
    chat = small().classes[0].model_copy(update={"turns_per_session": turns, "revisit_gap_s": gap})
    return WorkloadSpec.model_validate(small().model_copy(update={"classes": [chat]}).model_dump())


@pytest.mark.parametrize(
    "gap",
    [
        LengthDist(kind="exponential", mean=600),
        LengthDist(kind="lognormal", mean=3600, sigma=1.5, high=604800),
    ],
    ids=["exponential 10 min", "lognormal 1 h, heavy tail"],
)
def test_the_request_rate_is_the_class_rate_from_time_zero(gap: LengthDist) -> None:
    workload = spec(4.0, gap)  # 20 requests/s in sessions of 4 turns
    trace = list(arrivals(workload, 300, seed=3, share=0.5, steady_state=True))
    after = [a for a in trace if a.time >= 0]
    assert len(after) / 300 / 0.5 == pytest.approx(20, rel=0.1)
    cold = [a for a in arrivals(workload, 300, seed=3, share=0.5) if a.time < 300]
    assert len(cold) / 300 / 0.5 < 0.5 * 20  # from a cold start, mostly first turns
    assert [a.time for a in trace] == sorted(a.time for a in trace)


def test_sessions_in_progress_carry_their_history() -> None:
    trace = list(arrivals(spec(4.0, LengthDist(kind="exponential", mean=600)), 60, seed=1, steady_state=True))
    before = [a for a in trace if a.time < 0]
    assert before and all(a.segments[0].key[0] == "sys" for a in before)
    # a session in progress had completed a geometric number of turns (mean 4): its history shows them
    turns_before = [sum(1 for s in a.segments if s.key[0] == "turn") for a in before]
    assert statistics.fmean(turns_before) == pytest.approx(
        3, rel=0.15
    )  # turns done before the last, mean 4 - 1
    # every session in progress comes back after time 0, with the turn before 0 in its history
    ids = {a.request_id.rsplit("-", 1)[0] for a in before}
    returning = {a.request_id.rsplit("-", 1)[0] for a in trace if a.time >= 0 and "-p" in a.request_id}
    assert returning <= ids and len(returning) > 0


def test_single_turn_classes_are_unchanged() -> None:
    workload = spec(1.0, LengthDist(kind="fixed", mean=60))
    steady = list(arrivals(workload, 60, seed=2, steady_state=True))
    assert steady == list(arrivals(workload, 60, seed=2))


def test_the_cache_stage_counts_a_days_requests_from_the_first_hour() -> None:
    """Sessions 2 h apart over an 8-hour horizon: the day's requests are the class's rate x 86,400
    (from a cold start, the later turns of the first hours were missing: about half as many)."""
    spec = revisiting(7 * 86400)  # 0.25 requests/s, 6 turns a session, 2 h gaps
    store = TieredStore([Tier("store", TierRetention(retention_policy(spec.ttls), math.inf), 50e9)], KV)
    stage = run_cache_stage(spec, store, 8 * 3600, seed=3)
    assert stage.input_tokens_per_day / stage.mean_prompt_tokens == pytest.approx(0.25 * 86400, rel=0.15)
