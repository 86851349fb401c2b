"""The API front lowers its own threads' priority, and processes it starts through the core spawner
keep the original one (Linux keeps a nice value per thread; a child inherits its starter thread's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")

SCRIPT = """
import functools, json, os, subprocess, sys, threading
from deepinfer.server.priority import CoreSpawner, lower_front_priority
before = os.getpriority(os.PRIO_PROCESS, 0)
worker_started = threading.Event(); stop = threading.Event()
worker = threading.Thread(target=lambda: (worker_started.set(), stop.wait())); worker.start(); worker_started.wait()
spawner = CoreSpawner()
lowered = lower_front_priority(7, keep={spawner.native_id})
nice_of_child = functools.partial(subprocess.run, [sys.executable, "-c", "import os; print(os.nice(0))"],
                                  capture_output=True, text=True)
child = spawner.run(nice_of_child).stdout
late = nice_of_child().stdout
out = {"before": before, "lowered": lowered, "main": os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
       "worker": os.getpriority(os.PRIO_PROCESS, worker.native_id),
       "spawner": os.getpriority(os.PRIO_PROCESS, spawner.native_id), "child": int(child), "late_child": int(late)}
stop.set(); worker.join(); spawner.close()
print(json.dumps(out))
"""


def run_script() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_front_thread_but_the_spawner_is_lowered_and_its_children_keep_the_priority() -> None:
    out = run_script()
    base = out["before"]
    assert out["lowered"] >= 2  # the main thread and the worker thread at least
    assert out["main"] == out["worker"] == min(19, base + 7)
    assert out["spawner"] == base
    assert out["child"] == base  # an engine core started through the spawner: the original priority
    assert out["late_child"] == min(19, base + 7)  # started from a lowered thread: inherits it


@pytest.mark.parametrize("bad", [-1, 20])
def test_an_increment_outside_0_to_19_is_refused_naming_the_option(bad: int) -> None:
    from deepinfer.server.priority import lower_front_priority

    with pytest.raises(ValueError, match="--front-nice must be 0-19"):
        lower_front_priority(bad, keep=set())
