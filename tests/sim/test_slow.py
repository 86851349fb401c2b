"""The long checks: the simulator against a real server here, and a planner run at 1,000 requests/s.

Both assert timings (simulated against measured latencies, a wall-clock limit), so they are marked
``bench``: run by hand on a quiet machine (``pytest -m bench tests/sim``), never in CI, where a shared
host's load decides them (see bench/sim_validate.py and bench/sim_plan.py for the benchmarks)."""

import time
from pathlib import Path

import pytest

from deepinfer.sim.planner import Planner, PlanOptions, parse_slo
from deepinfer.sim.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.bench
def test_simulator_matches_the_engine_within_15_percent() -> None:
    """The held-out trace through one aggregated server and through 1 prefill + 1 decode worker
    behind the router, against the simulator fitted on the calibration trace's served steps."""
    from deepinfer.model_zoo import default_model_path
    from deepinfer.sim.validation import ServerSettings, TraceSpec, run_validation

    common = {"num_requests": 64, "request_rate": 1.0, "output_len": 64}
    result = run_validation(
        str(default_model_path()), TraceSpec(seed=1, **common), TraceSpec(seed=2, **common), ServerSettings()
    )
    for setup in ("aggregated", "disaggregated"):
        errors = result[setup]["validation"]["errors"]
        assert all(abs(e) < 0.15 for e in errors.values()), (setup, errors)


@pytest.mark.bench
def test_planner_for_1000_requests_per_second_under_two_minutes() -> None:
    spec = WorkloadSpec.load(ROOT / "examples" / "workloads" / "chat_agent.yaml")
    assert spec.rate_per_s == 1000
    start = time.perf_counter()
    report = Planner(spec, "gb200", parse_slo("ttft_p99=2s,tpot_p99=50ms"), PlanOptions()).plan()
    assert time.perf_counter() - start < 120
    assert report["slo_measured"]["tpot_p99"] <= 0.05
