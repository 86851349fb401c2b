"""One owner per disk tier directory (issue 34, defect 16): a second store on the directory fails
at once with one line naming it and the owner's PID; a killed owner leaves it usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deepinfer.kvstore.keys import StoreNamespace
from deepinfer.kvstore.owner import LOCK_NAME, StoreDirectoryInUse
from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy
from deepinfer.kvstore.store import DirSpec, KVStore

NS = StoreNamespace("weights", "tok", "layout", 16, "float32", (0,), "full")
POLICY = RetentionPolicy(dict(DEFAULT_TTLS), "chat")


def store(root: Path, shared: Path | None = None) -> KVStore:
    return KVStore(
        NS,
        256,
        8,
        POLICY,
        disk=DirSpec(root, 1 << 20),
        shared=DirSpec(shared, 1 << 20) if shared is not None else None,
    )


def test_a_second_store_on_the_directory_fails_at_once_naming_it_and_the_owner(tmp_path: Path) -> None:
    first = store(tmp_path)
    started = time.monotonic()
    with pytest.raises(StoreDirectoryInUse) as e:
        store(tmp_path)
    assert time.monotonic() - started < 5
    message = str(e.value)
    assert "\n" not in message
    assert str(tmp_path) in message and f"PID {os.getpid()}" in message
    assert "--kv-store-path" in message
    first.close()
    again = store(tmp_path)  # closing released it
    again.close()


def test_stores_on_other_directories_and_one_shared_tier_coexist(tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # the shared tier is multi-writer by design: no lock there
    a, b = store(tmp_path / "a", shared), store(tmp_path / "b", shared)
    assert not (shared / LOCK_NAME).exists()
    a.close()
    b.close()


OWNER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from deepinfer.kvstore.keys import StoreNamespace
    from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy
    from deepinfer.kvstore.store import DirSpec, KVStore
    ns = StoreNamespace("weights", "tok", "layout", 16, "float32", (0,), "full")
    KVStore(ns, 256, 8, RetentionPolicy(dict(DEFAULT_TTLS), "chat"), disk=DirSpec(Path(sys.argv[1]), 1 << 20))
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_a_killed_owner_leaves_the_directory_usable(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"  # bounded: the child exits within 120 s
        with pytest.raises(StoreDirectoryInUse, match=f"PID {proc.pid} on host "):
            store(tmp_path)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
    survivor = store(tmp_path)  # the kernel dropped the dead owner's lock
    survivor.close()
