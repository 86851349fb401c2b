"""Workload specs: validation, and the prefix structure of the traces they generate."""

import pytest

from deepinfer.sim.workload import LengthDist, TrafficClass, WorkloadSpec, arrivals


def chat(**changes) -> TrafficClass:
    fields = dict(
        name="chat", rate_per_s=5.0, system_prompts=3, system_prompt_tokens=LengthDist(kind="uniform", low=10, high=50),
        turns_per_session=4, revisit_gap_s=LengthDist(kind="exponential", mean=5),
        input_tokens=LengthDist(kind="lognormal", mean=30, sigma=0.5), output_tokens=LengthDist(mean=20),
    )  # fmt: skip
    return TrafficClass(**(fields | changes))


def test_later_turns_carry_the_whole_history() -> None:
    trace = list(arrivals(WorkloadSpec(classes=[chat()]), 300, seed=1))
    by_id = {a.request_id: a for a in trace}
    chained = 0
    for a in trace:
        name, session, turn = a.request_id.rsplit("-", 2)
        if int(turn) > 0:
            previous = by_id[f"{name}-{session}-{int(turn) - 1}"]
            history = previous.token_ids() + list(previous.output_token_ids())
            assert a.token_ids()[: len(history)] == history
            chained += 1
    assert chained > 100
    assert [a.time for a in trace] == sorted(a.time for a in trace)


def test_rates_time_of_day_and_share() -> None:
    profile = [0.0] * 12 + [2.0] * 12
    spec = WorkloadSpec(classes=[chat(turns_per_session=1, time_of_day=profile)])
    trace = list(arrivals(spec, 86400, seed=0, share=0.1))
    night = sum(1 for a in trace if a.time < 43200)
    assert night == 0
    assert len(trace) == pytest.approx(5.0 * 2.0 * 43200 * 0.1, rel=0.05)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rate_per_s": -1.0}, "rate_per_s"),
        ({"turns_per_session": 0.5}, "turns_per_session"),
        ({"time_of_day": [1.0] * 23}, "time_of_day"),
        ({"time_of_day": [0.0] * 24}, "not all zero"),
    ],
)
def test_bad_classes_name_the_field(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        chat(**changes)


def test_bad_distributions_and_specs() -> None:
    with pytest.raises(ValueError, match="needs 'mean'"):
        LengthDist(kind="lognormal")
    with pytest.raises(ValueError, match="finite 'high'"):
        LengthDist(kind="uniform", low=1)
    with pytest.raises(ValueError, match="unique"):
        WorkloadSpec(classes=[chat(), chat()])
    with pytest.raises(ValueError, match="share"):
        next(arrivals(WorkloadSpec(classes=[chat()]), 10, share=0))


def test_load_reports_the_file_and_field(tmp_path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("classes:\n  - name: chat\n    rate_per_s: -3\n    system_prompt_tokens: {mean: 10}\n"
                    "    input_tokens: {mean: 10}\n    output_tokens: {mean: 10}\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"(?s)w\.yaml.*rate_per_s"):
        WorkloadSpec.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        WorkloadSpec.load(tmp_path / "missing.yaml")
