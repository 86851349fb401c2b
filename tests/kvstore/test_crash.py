"""Crash safety and integrity of the file tiers: SIGKILLed writers, flipped bits, truncated, empty
and foreign files. Every read is a miss or exactly the bytes written; bad files are counted.

A SIGKILL keeps the page cache, so these kills cannot see a missing or misordered fsync; the crash
points with the page cache lost are ``test_fsync_order.py``'s."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest

from deepinfer.kvstore.file_tier import FileTier
from deepinfer.kvstore.keys import StoreNamespace, store_key
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.pack_tier import PackTier
from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy

NS = StoreNamespace("weights", "tok", "layout", 16, "float32", (0,), "full")
POLICY = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
NUM_KEYS = 64


def key_of(i: int, ns: StoreNamespace = NS) -> bytes:
    return store_key(ns.digest(), hashlib.sha256(b"block %d" % i).digest()[:16])


def payload_of(i: int) -> bytes:
    """Deterministic, different per key, 64-320 KiB: large enough that kills land mid-write."""
    seed = hashlib.sha256(b"payload %d" % i).digest()
    return (seed * ((64 + 8 * (i % 33)) * 1024 // 32))[: (64 + 8 * (i % 33)) * 1024]


def tier(root: Path, ns: StoreNamespace = NS) -> FileTier:
    return FileTier(
        "shared", root, ns.digest(), ns.describe(), 1 << 34, True, POLICY, TierCounters(), time.time
    )


def pack_tier(root: Path, ns: StoreNamespace = NS) -> PackTier:
    return PackTier("disk", root, ns.digest(), ns.describe(), 1 << 34, POLICY, TierCounters(), time.time)


TIERS = {"shared": tier, "disk": pack_tier}


def _writer(root: str, seed: int, kind: str) -> None:
    t = TIERS[kind](Path(root))
    rng = random.Random(seed)
    order = list(range(NUM_KEYS))
    while True:
        rng.shuffle(order)
        t.write_batch([(key_of(i), payload_of(i), "chat") for i in order[:4]], time.time())
        for i in order[4:8]:  # and let some blocks vanish, so keys get written again
            t.remove(key_of(i))


@pytest.mark.parametrize("kind", ["shared", "disk"])
def test_writers_killed_at_random_moments_never_leave_a_bad_record(tmp_path: Path, kind: str) -> None:
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    deadline = time.monotonic() + 60
    kills = 0
    while kills < 50 and time.monotonic() < deadline:
        proc = ctx.Process(target=_writer, args=(str(tmp_path), kills, kind), daemon=True)
        proc.start()
        time.sleep(rng.uniform(0.005, 0.08))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        assert proc.exitcode == -signal.SIGKILL
        kills += 1
    assert kills >= 50
    reader = TIERS[kind](tmp_path)  # the index is rebuilt from the directory
    now = time.time()
    present = 0
    for i in range(NUM_KEYS):
        got = reader.read(key_of(i), now)
        if got is not None:
            assert bytes(got) == payload_of(i)
            present += 1
    assert reader.counters.corrupt_reads == 0
    assert present > 0
    # Killed writers leave temporary files at most, never under a final name; gc takes stale ones.
    leftovers = list(tmp_path.rglob(".tmp.*"))
    assert all(p.name.startswith(".tmp.") for p in leftovers)


def _write(root: Path, count: int) -> FileTier:
    t = tier(root)
    t.write_batch([(key_of(i), payload_of(i), "agent") for i in range(count)], time.time())
    return t


def test_flipped_truncated_empty_and_foreign_files_are_counted_misses_and_removed(tmp_path: Path) -> None:
    t = _write(tmp_path, 6)
    paths = [t.path(key_of(i)) for i in range(6)]
    raw = bytearray(paths[0].read_bytes())
    raw[len(raw) // 2] ^= 0x10  # a flipped payload bit
    paths[0].write_bytes(raw)
    raw = bytearray(paths[1].read_bytes())
    raw[40] ^= 0x01  # a flipped header bit
    paths[1].write_bytes(raw)
    paths[2].write_bytes(paths[2].read_bytes()[:-100])  # truncated
    paths[3].write_bytes(b"")  # zero length
    other = StoreNamespace("other-weights", "tok", "layout", 16, "float32", (0,), "full")
    theirs = tier(tmp_path / "other2", other)
    theirs.write_batch([(key_of(4), payload_of(4), "chat")], time.time())
    paths[4].write_bytes(theirs.path(key_of(4)).read_bytes())  # another model's record under our name
    for p in paths:  # tampering reset the mtime, which holds the expiry: put it back
        os.utime(p, (time.time(), time.time() + 3600))
    reader = tier(tmp_path)
    now = time.time()
    assert reader.counters.corrupt_reads == 1  # the empty file, found by the index rebuild
    assert [reader.read(key_of(i), now) is None for i in range(6)] == [True] * 5 + [False]
    assert reader.counters.corrupt_reads == 5
    assert [p.exists() for p in paths] == [False] * 5 + [True]
    assert bytes(reader.read(key_of(5), now)) == payload_of(5)


def test_flipped_truncated_empty_and_foreign_packs_are_counted_misses_and_removed(tmp_path: Path) -> None:
    t = pack_tier(tmp_path)
    for i in range(6):  # one pack per batch
        t.write_batch([(key_of(i), payload_of(i), "agent")], time.time())
    packs = {i: t.packs_dir / t.index[key_of(i)].pack.name for i in range(6)}
    raw = bytearray(packs[0].read_bytes())
    raw[len(raw) // 2] ^= 0x10  # a flipped payload bit
    packs[0].write_bytes(raw)
    raw = bytearray(packs[1].read_bytes())
    raw[40] ^= 0x01  # a flipped record header bit
    packs[1].write_bytes(raw)
    packs[2].write_bytes(packs[2].read_bytes()[:-100])  # truncated
    packs[3].write_bytes(b"")  # zero length
    other = StoreNamespace("other-weights", "tok", "layout", 16, "float32", (0,), "full")
    theirs = pack_tier(tmp_path / "other2", other)
    theirs.write_batch([(key_of(4), payload_of(4), "chat")], time.time())
    packs[4].write_bytes(
        (theirs.packs_dir / theirs.index[key_of(4)].pack.name).read_bytes()
    )  # another model's
    reader = pack_tier(tmp_path)
    now = time.time()
    assert reader.counters.corrupt_reads == 3  # truncated, empty, foreign: found by the index rebuild
    assert [reader.read(key_of(i), now) is None for i in range(6)] == [True] * 5 + [False]
    assert reader.counters.corrupt_reads == 5
    assert [p.exists() for p in packs.values()] == [False] * 5 + [True]
    assert bytes(reader.read(key_of(5), now)) == payload_of(5)


def test_per_block_files_of_the_old_disk_format_are_counted_misses(tmp_path: Path) -> None:
    old = tier(tmp_path)  # the previous disk tier wrote one file per block, as the shared tier does
    old.write_batch([(key_of(i), payload_of(i), "chat") for i in range(3)], time.time())
    assert len(list(tmp_path.rglob("*.kvb"))) == 3
    t = pack_tier(tmp_path)
    assert t.counters.corrupt_reads == 3 and not t.index and not list(tmp_path.rglob("*.kvb"))
