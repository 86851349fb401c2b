"""The OpenMP thread policy of every engine entry point (issue 34, defect 19): a short spin,
``GOMP_SPINCOUNT=10000``, unless the user chose a wait policy, for the CLI (``python -m deepinfer.run``,
``deepinfer run`` and ``bench``), ``LLM()`` and the served core; and ``deepinfer run`` taking only the
CPUs free at start. Each case asks the process's OpenMP runtime itself (``OMP_DISPLAY_ENV=VERBOSE``
prints its settings when it loads): the runtime's default spins 300,000 times, ``ACTIVE`` 3e10 times."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.core.launch import core_environment
from deepinfer.threads import USER_CHOICES, free_cores, thread_environment
from tests.conftest import REPO_ROOT

PASSIVE = "GOMP_SPINCOUNT = '10000'"  # the policy (a short spin; the name is the test's history)
DEFAULT = "GOMP_SPINCOUNT = '300000'"
ACTIVE = "GOMP_SPINCOUNT = '30000000000'"


def run(args: list[str], runtimes: int = 1, **env: str) -> subprocess.CompletedProcess:
    """``args`` under this Python, with no OpenMP policy in the environment unless ``env`` sets one;
    ``runtimes``: the OpenMP runtimes expected to report (a re-exec after torch loaded: 2)."""
    base = {k: v for k, v in os.environ.items() if k not in USER_CHOICES and k != "GLIBC_TUNABLES"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**base, "DEEPINFER_ACCELERATOR": "cpu", "OMP_DISPLAY_ENV": "VERBOSE", **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("GOMP_SPINCOUNT = '") == runtimes, proc.stderr[-2000:]  # one report a runtime
    return proc


def test_the_policy_fills_in_only_what_the_user_left_unset() -> None:
    assert thread_environment({}) == {"GOMP_SPINCOUNT": "10000"}
    assert thread_environment({"OMP_WAIT_POLICY": "ACTIVE", "X": "1"}) == {
        "OMP_WAIT_POLICY": "ACTIVE",
        "X": "1",
    }
    assert thread_environment({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}
    assert core_environment({"X": "1"}) == {"GOMP_SPINCOUNT": "10000", "X": "1"}  # the served core


@pytest.mark.parametrize(
    "entry",
    [["-m", "deepinfer.run"], ["-m", "deepinfer.cli", "run"]],
    ids=["python -m deepinfer.run", "deepinfer run"],
)
def test_the_cli_runs_passive(tiny_model: Path, entry: list[str]) -> None:
    args = [*entry, "--model", str(tiny_model), "--max-tokens", "2", "--json", "def f():"]
    assert PASSIVE in run(args).stderr  # through the malloc re-exec
    assert PASSIVE in run(args, GLIBC_TUNABLES="glibc.malloc.hugetlb=0").stderr  # no re-exec
    assert ACTIVE in run(args, OMP_WAIT_POLICY="ACTIVE").stderr  # the user's choice is kept


def test_bench_runs_passive(tiny_model: Path) -> None:
    args = ["-m", "deepinfer.cli", "bench", "offline", "--model", str(tiny_model), "--num-requests", "2",
            "--input-len-range", "8", "16", "--output-len", "2"]  # fmt: skip
    assert PASSIVE in run(args).stderr


def test_llm_sets_the_policy_before_loading_torch(tiny_model: Path) -> None:
    script = f"from deepinfer import LLM\nLLM({str(tiny_model)!r}, num_kv_blocks=16)\n"
    proc = run(["-c", script])
    assert PASSIVE in proc.stderr and "OpenMP was loaded" not in proc.stderr


def test_llm_after_torch_says_how_to_fix_it(tiny_model: Path) -> None:
    script = f"import torch\nfrom deepinfer import LLM\nLLM({str(tiny_model)!r}, num_kv_blocks=16)\n"
    proc = run(["-c", script])
    assert DEFAULT in proc.stderr
    assert "OpenMP was loaded (torch imported) before deepinfer could set GOMP_SPINCOUNT=10000" in proc.stderr
    assert PASSIVE in run(["-c", script], GOMP_SPINCOUNT="10000").stderr  # the fix it names


@pytest.mark.parametrize(
    "malloc", ["", "glibc.malloc.hugetlb=0"], ids=["with the malloc re-exec", "without it"]
)
def test_a_script_that_imported_torch_first_is_re_executed(malloc: str) -> None:
    """The bench scripts import torch before they call ``reexec_with_malloc_tuning()``: the re-exec
    (also when the malloc tuning needs none) brings the policy; the first runtime spun."""
    script = "import torch\nfrom deepinfer.malloc_tuning import reexec_with_malloc_tuning\nreexec_with_malloc_tuning()\n"
    stderr = run(["-c", script], runtimes=2, **({"GLIBC_TUNABLES": malloc} if malloc else {})).stderr
    assert stderr.index(DEFAULT) < stderr.index(PASSIVE)


def test_main_in_process_with_tuning_off_never_replaces_the_process(tiny_model: Path) -> None:
    """``deepinfer.cli.main()`` called inside a process that imported torch first (a test under pytest)
    with DEEPINFER_MALLOC_TUNING=0 runs in that process: it used to execve it, so pytest restarted."""
    script = (
        "import os, torch\nfrom deepinfer.cli import main\nprint('started', flush=True)\n"
        f"rc = main(['plan', 'memory', '--model', {str(tiny_model)!r}, '--ep', '1'])\n"
        "print('still here', os.getpid(), rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k not in USER_CHOICES},
             "DEEPINFER_MALLOC_TUNING": "0", "DEEPINFER_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("started") == 1, proc.stdout  # a re-exec would run the script again
    assert "still here" in proc.stdout and proc.stdout.strip().endswith(" 0")
    assert "OpenMP was loaded" in proc.stderr  # the policy could not be applied, and it says so


def test_free_cores_leaves_out_the_cpus_busy_programs_hold() -> None:
    """Two CPU-bound children on this host's CPUs: ``free_cores`` counts them (at least 1 is left)."""
    cores = len(os.sched_getaffinity(0))
    quiet = free_cores()
    children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        busy = free_cores()
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=30)
    assert 1 <= busy <= cores and busy <= max(1, quiet - 1)
