"""A dead or hung rank is a bounded-time error for the other ranks and the front; the ranks' collective
sequences are checked in debug mode. Real processes on loopback, all stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("rank_scripts.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return {
        **os.environ,
        "DEEPINFER_NUM_THREADS": "1",
        "DEEPINFER_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO_ROOT),
    }


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def start_front(timeout_s: float) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "front", str(timeout_s)],
        cwd=REPO_ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("PIDS"):
            pids = [int(x) for x in line.split()[1:]]
        if line.startswith("RUNNING") or time.monotonic() > deadline:
            break
    return proc, pids


def finish(proc: subprocess.Popen, pids: list[int], within: float) -> tuple[float, str]:
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the front did not exit within {within} s of the rank failure")
    return time.monotonic() - start, err


@pytest.mark.parametrize("how", ["killed", pytest.param("hung", marks=pytest.mark.slow)])
def test_dead_or_hung_rank_fails_the_others_and_the_front(how: str) -> None:
    """SIGKILL (or SIGSTOP: a hang) rank 1 while tokens flow: rank 0's next collective fails and it
    reports; the front raises RankFailedError and exits non-zero within 60 s; no rank is left."""
    proc, pids = start_front(timeout_s=8.0)
    assert len(pids) == 2, "the front did not start its ranks"
    os.kill(pids[1], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    elapsed, err = finish(proc, pids, within=60)
    assert proc.returncode != 0
    assert "RankFailedError" in err, err[-3000:]
    assert "rank 0:" in err, f"the surviving rank did not report its own failure:\n{err[-3000:]}"
    if how == "killed":
        assert "data-parallel rank 1" in err and "exited with code -9" in err
    assert elapsed < 60
    for pid in pids:
        assert gone(pid, 10), f"rank pid {pid} outlived the front"


def test_collective_sequence_mismatch_is_detected() -> None:
    """Debug mode: when one rank issued a different collective sequence, every rank raises, naming it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "collectives", str(r), "2", str(port)],
            cwd=REPO_ROOT,
            env={**env(), "GLOO_SOCKET_IFNAME": "lo"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert "MISMATCH rank 0: ranks [1]" in outs[0]
    assert "MISMATCH rank 1: ranks [0]" in outs[1]
