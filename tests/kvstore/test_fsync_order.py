"""Crash points of the file tiers with the page cache lost (issue 34: durability tests that can fail).

A SIGKILLed writer keeps the page cache, so the kill test cannot see a missing or misordered fsync.
Here every write, fsync, rename, link, unlink and mkdir the tiers make is recorded (``crashfs``),
and for every prefix of that log, in each crash model (``crashfs.MODES``: unsynced data lost with
unsynced directory entries, with directory operations kept in order, or torn), the state a crash
may leave is written out and a fresh tier opened on it: every block reported durable before the
crash point reads back exactly, and nothing reads as a wrong block (a torn record is a miss). The
checker is shown to catch writers with the fsync before the rename, or the directory fsync, removed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deepinfer.kvstore import file_tier, pack_tier
from deepinfer.kvstore.file_tier import FileTier
from deepinfer.kvstore.keys import StoreNamespace, store_key
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.pack_tier import PackTier
from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy
from tests.kvstore.crashfs import MODES, Recorder, committed, crash_state

NS = StoreNamespace("weights", "tok", "layout", 16, "float32", (0,), "full")
POLICY = RetentionPolicy(dict(DEFAULT_TTLS), "chat")


def key_of(i: int) -> bytes:
    return store_key(NS.digest(), hashlib.sha256(b"crash block %d" % i).digest()[:16])


def payload_of(i: int) -> bytes:
    seed = hashlib.sha256(b"crash payload %d" % i).digest()
    return (seed * 160)[: 1000 + 700 * (i % 5)]


def open_disk(root: Path) -> PackTier:
    return PackTier("disk", root, NS.digest(), NS.describe(), 1 << 30, POLICY, TierCounters(), time.time)


def open_shared(root: Path) -> FileTier:
    return FileTier(
        "shared", root, NS.digest(), NS.describe(), 1 << 30, True, POLICY, TierCounters(), time.time
    )


def batch(*ids: int) -> list[tuple[bytes, bytes, str]]:
    return [(key_of(i), payload_of(i), "chat") for i in ids]


def workload(tier: PackTier | FileTier, rec: Recorder) -> None:
    """Batches of new blocks, a repeated block (only touched), a hit, a removal, a touch-only batch."""
    now = time.time()
    for ids in ((0, 1, 2), (3, 4, 0), (5,)):
        tier.write_batch(batch(*ids), now)
        rec.commit([key_of(i) for i in ids])
    tier.touch(key_of(1), now + 1, "agent")
    rec.forget([key_of(3)])  # before the call: from its first unlink on, the block may be gone
    tier.remove(key_of(3))
    tier.write_batch(batch(6, 7), now + 2)
    rec.commit([key_of(6), key_of(7)])
    tier.touch(key_of(2), now + 3, "agent")
    tier.write_batch([], now + 3)


def record(tmp_path: Path, opener: Callable[[Path], PackTier | FileTier]) -> Recorder:
    """Create a tier in the empty folder ``tmp_path / 'store'`` and run ``workload`` on it, with
    the tiers' ``os`` recorded from the start (the folder itself is taken as durable)."""
    root = tmp_path / "store"
    root.mkdir()
    rec = Recorder(root)
    with pytest.MonkeyPatch.context() as mp:
        rec.install(mp, pack_tier, file_tier)
        workload(opener(root), rec)
    return rec


def crash_problems(rec: Recorder, opener: Callable[[Path], PackTier | FileTier], scratch: Path) -> list[str]:
    """Every crash point of ``rec.log`` in every mode: what a fresh tier on the crash state gets wrong."""
    problems = []
    ids = range(8)
    for k in range(len(rec.log) + 1):
        prefix = rec.log[:k]
        must = committed(prefix)
        for mode in MODES:
            dest = scratch / f"crash-{k}-{mode}"
            crash_state(rec.base, prefix, mode, dest)
            tier = opener(dest)
            now = time.time()
            for i in ids:
                got = tier.read(key_of(i), now)
                if got is None and key_of(i) in must:
                    problems.append(f"{mode}, after op {k} {prefix[-1][0]}: committed block {i} lost")
                elif got is not None and bytes(got) != payload_of(i):
                    problems.append(f"{mode}, after op {k}: block {i} reads wrong bytes")
            shutil.rmtree(dest)
    return problems


@pytest.mark.parametrize("opener", [open_disk, open_shared], ids=["disk", "shared"])
def test_no_crash_point_loses_a_committed_block_or_reads_a_wrong_one(tmp_path: Path, opener) -> None:
    rec = record(tmp_path, opener)
    kinds = {op[0] for op in rec.log}
    assert {"open", "write", "fsync", "close", "commit"} <= kinds
    assert ("rename" if opener is open_disk else "link") in kinds
    assert len(rec.log) > 30  # every batch's calls were seen
    assert crash_problems(rec, opener, tmp_path / "scratch") == []


def _no_fsync_pack(tmp: str, bufs: list) -> None:
    """``pack_tier._write_synced`` with its fsync removed: the rename may name bytes not on disk."""
    fd = pack_tier.os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    pack_tier.os.writev(fd, [memoryview(b).cast("B") for b in bufs])
    pack_tier.os.close(fd)


def test_the_checker_finds_a_pack_renamed_before_its_fsync(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(pack_tier, "_write_synced", _no_fsync_pack)
    rec = record(tmp_path, open_disk)
    problems = crash_problems(rec, open_disk, tmp_path / "scratch")
    assert any(p.startswith("ordered") and "lost" in p for p in problems)
    assert any(p.startswith("lost") and "lost" in p for p in problems)
    assert not any("wrong bytes" in p for p in problems)  # torn packs are misses, never wrong KV


@pytest.mark.parametrize("opener", [open_disk, open_shared], ids=["disk", "shared"])
def test_the_checker_finds_a_missing_directory_fsync(tmp_path: Path, monkeypatch, opener) -> None:
    monkeypatch.setattr(pack_tier, "fsync_dir", lambda path: None)
    monkeypatch.setattr(file_tier, "fsync_dir", lambda path: None)
    rec = record(tmp_path, opener)
    problems = crash_problems(rec, opener, tmp_path / "scratch")
    assert any(p.startswith("lost") and "lost" in p for p in problems)
    assert not any(p.startswith(("ordered", "torn")) for p in problems)  # only a lost directory shows it


def test_the_checker_finds_a_shared_block_linked_before_its_fsync(tmp_path: Path, monkeypatch) -> None:
    real = file_tier._write_tmp

    def no_fsync(tmp, header, payload, now, expiry):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(file_tier.os, "fsync", lambda fd: None)
            real(tmp, header, payload, now, expiry)

    monkeypatch.setattr(file_tier, "_write_tmp", no_fsync)
    rec = record(tmp_path, open_shared)
    problems = crash_problems(rec, open_shared, tmp_path / "scratch")
    assert any(p.startswith("ordered") and "lost" in p for p in problems)
    assert not any("wrong bytes" in p for p in problems)


def test_the_checker_finds_store_folders_created_without_a_sync(tmp_path: Path, monkeypatch) -> None:
    """The tier's folders (kv1/<namespace>/packs) made as before, by a plain makedirs: a crash can take
    them, and every pack in them, away."""
    monkeypatch.setattr(pack_tier, "make_dirs", lambda path: pack_tier.os.makedirs(path, exist_ok=True))
    rec = record(tmp_path, open_disk)
    problems = crash_problems(rec, open_disk, tmp_path / "scratch")
    assert any(p.startswith("lost") and "committed block 0 lost" in p for p in problems)
