"""The planner: SLO parsing, clear errors, a small search end to end."""

import json
import subprocess
import sys

import pytest

from deepinfer.sim.planner import NoDeploymentMeetsSLO, Planner, PlanOptions, _bisect, parse_slo
from deepinfer.sim.workload import LengthDist, TrafficClass, WorkloadSpec

FAST = PlanOptions(cache_requests=2000, cache_horizon_s=4 * 3600, cache_warm_s=60, window_s=10, warmup_s=3,
                   drain_s=8, max_simulations=4, decode_ep_options=[32], prefill_ep_options=[8])  # fmt: skip


def small() -> WorkloadSpec:
    return WorkloadSpec(
        classes=[
            TrafficClass(
                name="chat", rate_per_s=20, system_prompts=10, system_prompt_tokens=LengthDist(mean=1000),
                turns_per_session=3, revisit_gap_s=LengthDist(kind="exponential", mean=600),
                input_tokens=LengthDist(kind="uniform", low=100, high=1000), output_tokens=LengthDist(mean=100),
            )
        ]
    )  # fmt: skip


def test_parse_slo() -> None:
    assert parse_slo("ttft_p99=2s,tpot_p99=50ms") == {"ttft_p99": 2.0, "tpot_p99": 0.05}
    with pytest.raises(ValueError, match="unknown SLO metric"):
        parse_slo("latency=2s")
    with pytest.raises(ValueError, match="METRIC=NUMBER"):
        parse_slo("ttft_p99=2 seconds")
    with pytest.raises(ValueError, match="positive"):
        parse_slo("ttft_p99=0s")


def test_unknown_chip_and_missing_price() -> None:
    with pytest.raises(KeyError, match="known chips"):
        Planner(small(), "h300", {"ttft_p99": 2.0}, FAST)
    with pytest.raises(ValueError, match="--usd-per-chip-hour"):
        Planner(small(), "h200", {"ttft_p99": 2.0}, FAST)


def test_a_plan_meets_its_slo_and_prices_tokens() -> None:
    report = Planner(small(), "gb200", parse_slo("ttft_p99=3s,tpot_p99=100ms"), FAST).plan()
    assert report["evaluated"][-1]["meets"] or any(e["meets"] for e in report["evaluated"])
    measured = report["slo_measured"]
    assert measured["ttft_p99"] <= 3.0 and measured["tpot_p99"] <= 0.1
    assert report["usd_per_day"] == pytest.approx(report["deployment"]["chips"] * 10.582 * 24)
    assert report["usd_per_m_output"] > 0 and report["usd_per_m_input_uncached"] > 0
    assert report["usd_per_m_input_cached"] is None  # storage not priced
    assert 0 < sum(report["cache_hit_rate"].values()) < 1


def test_an_impossible_slo_names_the_closest_deployment() -> None:
    with pytest.raises(NoDeploymentMeetsSLO, match=r"closest: .* misses by tpot_p99 \d+\.\d+x") as info:
        Planner(
            small(), "gb200", parse_slo("tpot_p99=1ms"), FAST.model_copy(update={"max_simulations": 2})
        ).plan()
    assert info.value.closest["misses"]["tpot_p99"] > 1


def test_cli_errors_are_clear(tmp_path) -> None:
    bad = tmp_path / "w.yaml"
    bad.write_text("classes:\n  - name: chat\n    rate_per_s: -1\n    system_prompt_tokens: {mean: 10}\n"
                   "    input_tokens: {mean: 10}\n    output_tokens: {mean: 10}\n")  # fmt: skip
    run = [sys.executable, "-m", "deepinfer.cli", "plan", "--slo", "ttft_p99=2s"]
    out = subprocess.run([*run, "--workload", str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "rate_per_s" in out.stderr
    good = tmp_path / "ok.yaml"
    good.write_text(json.dumps(small().model_dump()))
    out = subprocess.run(
        [*run, "--workload", str(good), "--chip", "tpu9"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "unknown chip 'tpu9'" in out.stderr


def test_the_search_grows_by_the_miss_then_bisects() -> None:
    tried = []

    def meets(size: int) -> tuple[bool, float]:
        tried.append(size)
        return size >= 13, 20 / size  # the smallest that meets is 13

    assert _bisect(4, meets, budget=10) == 13
    assert tried[:3] == [4, 8, 16]  # grows by the miss (clamped to 2x), then bisects 8..16
    assert len(tried) <= 7
    tried.clear()
    assert _bisect(40, meets, budget=10) == 13 and tried[:2] == [40, 20]  # starts above: halves
    assert _bisect(4, lambda s: (False, 3.0), budget=3) == 32  # 4, 8, 16 missed: the next to try
