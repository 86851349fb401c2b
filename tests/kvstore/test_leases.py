"""The store-side lease table of the P/D handoff: durable files, idempotent release, expiry, and
eviction in the shared tier that skips leased blocks (also for a lease taken by another process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.kvstore.file_tier import FileTier
from deepinfer.kvstore.leases import LeaseTable, check_handoff_id
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.retention import RetentionPolicy


def test_take_release_expire(tmp_path: Path) -> None:
    table = LeaseTable(tmp_path)
    table.take("h1", ["aa" * 32], expires_unix=100.0, owner="p")
    table.take("h2", ["bb" * 32], expires_unix=200.0, owner="q")
    assert table.get("h1").keys == ("aa" * 32,) and len(table.leases()) == 2
    assert [lease.handoff_id for lease in table.leases("p")] == ["h1"]
    assert table.held_keys(now=150.0) == {bytes.fromhex("bb" * 32)}  # h1 expired: holds nothing
    assert table.expire(now=150.0, owner="q") == []  # q's lease has not expired; p's is not q's
    assert table.expire(now=150.0) == ["h1"] and table.expire(now=150.0) == []
    assert table.release("h2") and not table.release("h2")  # idempotent
    assert table.leases() == [] and not any(p.name.startswith(".tmp") for p in table.dir.iterdir())
    assert table.store_id() == LeaseTable(tmp_path).store_id() and len(table.store_id()) == 32


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x" * 129, "a b"])
def test_handoff_ids_that_are_not_file_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="handoff_id"):
        check_handoff_id(bad)


def test_shared_tier_eviction_skips_blocks_leased_by_another_process(tmp_path: Path) -> None:
    now = 1000.0
    policy = RetentionPolicy({"chat": 3600.0}, "chat")
    tier = FileTier("shared", tmp_path, b"n" * 32, {}, 3 * 4096, True, policy, TierCounters(), lambda: now)
    keys = [bytes([i]) * 32 for i in range(3)]
    for i, key in enumerate(keys):
        now = 1000.0 + i
        tier.write_batch([(key, b"x" * 3000, "chat")], now)
    # another process leases the oldest block (the eviction's first victim otherwise)
    code = (
        "import sys, time; from deepinfer.kvstore.leases import LeaseTable; "
        f"LeaseTable(sys.argv[1]).take('h', ['{keys[0].hex()}'], time.time() + 600, 'other')"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    now = 1010.0
    tier.write_batch([(bytes([9]) * 32, b"x" * 3000, "chat")], now)
    assert tier.contains(keys[0], now) and not tier.contains(keys[1], now)
