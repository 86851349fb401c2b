"""``deepinfer plan`` as a user runs it (issue 34, defect 20): every bad input is one line naming the
file, field or flag and what it accepts, exit code 2, no traceback; and the daily output capacity
of the chosen deployment counts all of its chips (it was multiplied by the decode chips only, so a
plan reported more output a day than its capacity)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.sim.planner import Evaluation, Planner, output_per_day_at_peak_load, parse_slo
from deepinfer.sim.workload import WorkloadSpec
from tests.conftest import REPO_ROOT
from tests.sim.test_planner import FAST, small

TINY_MODEL = REPO_ROOT / "deepinfer" / "models" / "deepinfer-tiny-coder"
GOOD_CLASS = (
    "    input_tokens: {mean: 10}\n    output_tokens: {mean: 10}\n    system_prompt_tokens: {mean: 10}\n"
)


def deepinfer_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "plan", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def workload(tmp_path: Path, text: str) -> str:
    path = tmp_path / "w.yaml"
    path.write_text(text)
    return str(path)


BAD_WORKLOADS = {
    "missing file": (None, "does not exist"),
    "a folder": ("", "cannot be read: Is a directory"),
    "broken YAML": ("classes: [\n", "is not valid YAML: expected the node content, but found '<stream end>' at line 2"),
    "empty file": ("", "the top level: must be a mapping of fields (got NoneType)"),
    "not a mapping": ("just a string\n", "the top level: must be a mapping of fields (got str)"),
    "wrong type": (f"classes:\n  - name: chat\n    rate_per_s: abc\n{GOOD_CLASS}",
                   "classes[0].rate_per_s: Input should be a valid number"),
    "out of range": (f"classes:\n  - name: chat\n    rate_per_s: -1\n{GOOD_CLASS}",
                     "classes[0].rate_per_s: Input should be greater than 0 (got -1)"),
    "not finite": (f"classes:\n  - name: chat\n    rate_per_s: .inf\n{GOOD_CLASS}",
                   "classes[0].rate_per_s: Input should be a finite number (got inf)"),
    "missing fields": ("classes:\n  - name: chat\n    rate_per_s: 1\n", "classes[0].system_prompt_tokens: required"),
    "unknown field": (f"classes:\n  - name: chat\n    rate_per_s: 1\n    bogus: 3\n{GOOD_CLASS}",
                      "classes[0].bogus: unknown field; known: name, rate_per_s,"),
}  # fmt: skip


def _one_line_error(proc: subprocess.CompletedProcess, expected: str, prog: str = "deepinfer plan") -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "pydantic" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize(("text", "expected"), BAD_WORKLOADS.values(), ids=BAD_WORKLOADS.keys())
def test_bad_workload_files(tmp_path: Path, text: str | None, expected: str) -> None:
    if text is None:
        path = str(tmp_path / "nope.yaml")
    elif expected.startswith("cannot be read"):
        path = str(tmp_path)
    else:
        path = workload(tmp_path, text)
    proc = deepinfer_plan("--workload", path, "--slo", "ttft_p99=2s")
    _one_line_error(
        proc, f"{path} {expected}" if not expected.startswith(("the top", "classes")) else expected
    )
    assert path in proc.stderr


BAD_FLAGS = {
    "unknown scenario": (["--scenario", "nope"], "--scenario: unknown scenario 'nope'; known: deepseek-2026"),
    "no SLO": (["--workload", "W"], "give --workload W.yaml --slo"),
    "bad SLO": (["--workload", "W", "--slo", "latency=2s"], "--slo: unknown SLO metric 'latency'; known: ttft_mean"),
    "unknown chip": (["--workload", "W", "--slo", "ttft_p99=2s", "--chip", "tpu9"],
                     "--chip: unknown chip 'tpu9'; known chips: ascend950dt"),
    "no price": (["--workload", "W", "--slo", "ttft_p99=2s", "--chip", "h200"], "pass --usd-per-chip-hour"),
    "zero simulations": (["--workload", "W", "--slo", "ttft_p99=2s", "--max-simulations", "0"],
                         "--max-simulations: Input should be greater than or equal to 1 (got 0)"),
    "NaN price": (["--workload", "W", "--slo", "ttft_p99=2s", "--usd-per-chip-hour", "nan"],
                  "--usd-per-chip-hour: Input should be a finite number (got nan)"),
    "plot folder": (["--workload", "W", "--slo", "ttft_p99=2s", "--plot", "/nonexistent/p.png"],
                    "--plot /nonexistent/p.png: the folder /nonexistent does not exist"),
}  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_bad_flags(tmp_path: Path, args: list[str], expected: str) -> None:
    good = workload(tmp_path, json.dumps(small().model_dump()))
    _one_line_error(deepinfer_plan(*[good if a == "W" else a for a in args]), expected)


BAD_MEMORY = {
    "no config": (["--model", "/nonexistent"], "--model /nonexistent: no config.json there"),
    "not JSON": (["--model", "{bad}"], "config.json is not valid JSON"),
    "not an object": (["--model", "{list}"], "config.json must hold a JSON object of model settings"),
    "unknown model type": (["--model", "{empty}"], "model_type=None is not supported; supported: deepseek_v3"),
    "EP zero": (["--model", str(TINY_MODEL), "--ep", "0"], "--ep must be >= 1, got 0"),
    "EP not dividing": (["--model", str(TINY_MODEL), "--ep", "32"], "--ep 32: 16 routed experts"),
    "negative seqs": (["--model", str(TINY_MODEL), "--ep", "8", "--max-num-seqs", "-1"],
                      "--max-num-seqs must be >= 1, got -1"),
}  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), BAD_MEMORY.values(), ids=BAD_MEMORY.keys())
def test_bad_memory_plans(tmp_path: Path, args: list[str], expected: str) -> None:
    files = {"bad": "{not json", "list": "[]", "empty": "{}"}
    for name, text in files.items():
        (tmp_path / f"{name}.json").write_text(text)
    args = [a.format(**{n: tmp_path / f"{n}.json" for n in files}) for a in args]
    _one_line_error(deepinfer_plan("memory", *args), expected)


def test_memory_plan_of_the_bundled_model() -> None:
    proc = deepinfer_plan("memory", "--model", str(TINY_MODEL), "--ep", "1", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [p["ep"] for p in json.loads(proc.stdout)] == [1, 8]


def test_the_output_capacity_at_peak_load_by_hand() -> None:
    assert output_per_day_at_peak_load(40.0, 100.0) == 40 * 100 * 86_400 == 345_600_000


@pytest.mark.parametrize("turns", [1.0, 3.0], ids=["single requests", "sessions of 3 turns"])
def test_a_plan_never_reports_more_daily_output_than_its_capacity(turns: float) -> None:
    """A day whose peak hour runs at twice the mean rate: the capacity at the peak load is twice the
    day's output (before: the simulated rate per chip, which divides by all chips, times the decode
    chips only, below the day's output). The simulated window carries the peak hour's requests:
    with sessions, its trace starts in their steady state (before: from none in progress, so the
    window held the first turns only)."""
    profile = [2.0 if h == 0 else 1.0 for h in range(24)]
    chat = small().classes[0].model_copy(update={"time_of_day": profile, "turns_per_session": turns})
    spec = WorkloadSpec.model_validate(small().model_copy(update={"classes": [chat]}).model_dump())
    report = Planner(spec, "gb200", parse_slo("ttft_p99=3s,tpot_p99=100ms"), FAST).plan()
    capacity = report["output_tokens_per_day_capacity_at_peak_load"]
    assert report["peak_requests_per_s"] == 40
    assert capacity == pytest.approx(40 * 100 * 86_400)  # 100 output tokens a request
    assert report["output_tokens_per_day"] == pytest.approx(capacity * statistics.fmean(profile) / 2)
    simulated = report["simulation"]
    share = simulated["simulated"]["traffic_share"]
    arrived_per_s = simulated["requests_arrived"] / simulated["window_s"] / share
    assert arrived_per_s == pytest.approx(40, rel=0.3)  # the peak hour's request rate


def test_a_ttft_miss_that_a_larger_prefill_pool_does_not_fix_grows_decode(monkeypatch) -> None:
    """Whole-cluster runs whose TTFT waits on the decode pool (as the chat + agent plan's did at its
    full peak load): growing prefill once does not help, so decode grows, and the plan keeps the
    prefill size its TTFT screens chose (before: prefill grew until the budget ran out, no plan)."""
    planner = Planner(small(), "gb200", parse_slo("ttft_p99=3s,tpot_p99=100ms"), FAST.model_copy(update={"max_simulations": 6}))  # fmt: skip
    monkeypatch.setattr(planner, "decode_miss", lambda cache, d: None)
    seen = []

    def evaluate(d, ttft_only):
        seen.append((ttft_only, d.prefill_chips, d.decode_chips))
        decode_bound = not ttft_only and d.decode_chips < 4 * d.decode_ep
        result = {"ttft_s": {"p99": 7.5 if decode_bound else 1.0}, "tpot_s": {"p99": 0.05},
                  "tokens_per_s_per_user": 20.0, "output_tokens_per_s_per_chip": 100.0, "requests_arrived": 50}  # fmt: skip
        return Evaluation(d, planner.usd_per_day(d), result, {"ttft_p99": 2.5} if decode_bound else {})

    monkeypatch.setattr(planner, "_evaluate", evaluate)
    report = planner.plan()
    whole = [(p, dc) for ttft_only, p, dc in seen if not ttft_only]
    screened = whole[0][0]  # the prefill size the TTFT screens chose
    assert report["deployment"]["prefill_chips"] == screened
    assert report["deployment"]["decode_chips"] >= 4 * report["deployment"]["decode_ep"]
    assert whole[1][0] > whole[0][0] and whole[2] == (
        screened,
        whole[0][1] * 2,
    )  # grew prefill once, then decode
