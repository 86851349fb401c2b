"""The write-behind path: a bounded backlog that drops (and counts) saves instead of blocking, a
failed batch that does not stop the writer, and a batch made durable before any of its names appear."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from deepinfer.kvstore import pack_tier
from deepinfer.kvstore.file_tier import FileTier
from deepinfer.kvstore.keys import StoreNamespace, store_key
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.pack_tier import PackTier
from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy
from deepinfer.kvstore.store import DirSpec, KVStore

NS = StoreNamespace("weights", "tok", "layout", 16, "float32", (0,), "full")
POLICY = RetentionPolicy(dict(DEFAULT_TTLS), "chat")


def keys(n: int) -> list[bytes]:
    return [store_key(NS.digest(), bytes([i]) * 16) for i in range(n)]


def commit(store: KVStore, key: bytes, fill: int) -> None:
    slot = store.reserve()
    assert slot is not None
    store.slot(slot).fill_(fill)
    store.commit(key, slot, "chat")


def test_a_full_backlog_drops_saves_to_host_only_and_counts_them(tmp_path: Path) -> None:
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path, 1 << 20), max_pending_writes=4)
    gate = threading.Event()
    write_batch = store.files[0].write_batch

    def stalled(items, now):  # a disk that does not keep up
        assert gate.wait(30)
        write_batch(items, now)

    store.files[0].write_batch = stalled
    ks = keys(11)
    t0 = time.perf_counter()
    for i, key in enumerate(ks):
        commit(store, key, i)
    assert time.perf_counter() - t0 < 5  # the engine never waited for the stalled writer
    assert store.snapshot()["writes_dropped"] == 7
    assert store.lookup(ks) == 11  # every block is still served from host memory
    gate.set()
    assert store.flush(30)
    assert store.host.leases == {}  # the dropped saves' slots were released, not leaked
    store.close()
    disk = tier(tmp_path)
    assert [disk.read(k, time.time()) is not None for k in ks] == [True] * 4 + [False] * 7
    assert bytes(disk.read(ks[3], time.time())) == bytes([3]) * 256


def test_max_pending_writes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_pending_writes"):
        KVStore(NS, 256, 4, POLICY, disk=DirSpec(tmp_path, 1 << 20), max_pending_writes=0)


def tier(root: Path) -> PackTier:
    return PackTier("disk", root, NS.digest(), NS.describe(), 1 << 30, POLICY, TierCounters(), time.time)


def test_a_disk_batch_is_one_pack_synced_once_and_a_failure_leaves_no_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = []
    real_fsync = os.fsync
    t = tier(tmp_path)
    monkeypatch.setattr(pack_tier.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    ks = keys(20)
    t.write_batch([(k, bytes([i]) * 5000, "chat") for i, k in enumerate(ks)], time.time())
    assert len(synced) == 2  # the pack, then its folder: not one per block
    assert len(list(tmp_path.rglob("*.kvp"))) == 1 and t.counters.writes == 20
    assert all(bytes(t.read(k, time.time())) == bytes([i]) * 5000 for i, k in enumerate(ks))
    assert not list(tmp_path.rglob(".tmp.*"))

    # A failure while writing a batch: nothing of it gets a name, no temporary file is left.
    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pack_tier.os, "writev", full)
    more = [store_key(NS.digest(), bytes([100 + i]) * 16) for i in range(6)]
    with pytest.raises(OSError, match="No space"):
        t.write_batch([(k, b"y" * 5000, "chat") for k in more], time.time())
    assert all(k not in t.index for k in more) and len(list(tmp_path.rglob("*.kvp"))) == 1
    assert not list(tmp_path.rglob(".tmp.*"))
    assert tier(tmp_path).index.keys() == set(ks)  # a restart sees exactly the committed batch


def test_a_shared_tier_fsyncs_each_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    t = FileTier(
        "shared", tmp_path, NS.digest(), NS.describe(), 1 << 30, True, POLICY, TierCounters(), time.time
    )
    synced.clear()  # the namespace description written at creation
    t.write_batch([(k, b"z" * 3000, "chat") for k in keys(5)], time.time())
    assert len(synced) >= 5 + 1  # every file, and the directories
    assert t.counters.writes == 5


def test_a_failed_batch_is_logged_and_the_writer_keeps_writing(tmp_path: Path, caplog) -> None:
    store = KVStore(NS, 256, 16, POLICY, disk=DirSpec(tmp_path, 1 << 20))
    write_batch = store.files[0].write_batch
    failures = []

    def once_full(items, now):
        if not failures:
            failures.append(len(items))
            raise OSError(28, "No space left on device")
        write_batch(items, now)

    store.files[0].write_batch = once_full
    ks = keys(2)
    commit(store, ks[0], 1)
    assert store.flush(30)
    commit(store, ks[1], 2)
    assert store.flush(30)  # the writer survived the failure
    assert failures == [1] and "disk tier failed writing 1 blocks" in caplog.text
    assert store.snapshot()["tiers"]["disk"]["write_errors"] == 1
    assert store.host.leases == {}
    store.close()
    disk = tier(tmp_path)
    assert disk.read(ks[0], time.time()) is None and bytes(disk.read(ks[1], time.time())) == bytes([2]) * 256


def test_the_window_gathers_steps_into_one_batch_and_a_flush_ends_it_at_once(tmp_path: Path) -> None:
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path, 1 << 20), write_window_s=30.0)
    batches = []
    write_batch = store.files[0].write_batch
    store.files[0].write_batch = lambda items, now: (batches.append(len(items)), write_batch(items, now))
    ks = keys(9)
    for step in range(3):  # three engine steps' saves, 3 blocks each
        store.commit_many(
            [(k, _filled(store, 3 * step + i), "chat") for i, k in enumerate(ks[3 * step : 3 * step + 3])]
        )
        time.sleep(0.05)
    assert batches == []  # still inside the 30 s window: nothing written yet, all served from host
    assert store.lookup(ks) == 9
    t0 = time.perf_counter()
    assert store.flush(10)
    assert time.perf_counter() - t0 < 5  # the flush did not wait out the window
    assert batches == [9]  # one batch (one pair of syncs) for the three steps
    store.close()
    assert tier(tmp_path).index.keys() == set(ks)


def test_a_store_with_a_shared_tier_writes_without_a_window(tmp_path: Path) -> None:
    store = KVStore(
        NS, 256, 8, POLICY, disk=DirSpec(tmp_path / "d", 1 << 20), shared=DirSpec(tmp_path / "s", 1 << 20),
        write_window_s=30.0,
    )  # fmt: skip
    assert store.write_window_s == 0.0
    commit(store, keys(1)[0], 7)
    deadline = time.monotonic() + 10
    while store.snapshot()["tiers"]["shared"]["writes"] < 1:  # no flush: the handoff polls for files
        assert time.monotonic() < deadline, "the shared tier waited for a window"
        time.sleep(0.01)
    store.close()


def _filled(store: KVStore, fill: int) -> int:
    slot = store.reserve()
    assert slot is not None
    store.slot(slot).fill_(fill)
    return slot


def test_closed_stores_leave_no_thread_and_free_their_host_memory(tmp_path: Path) -> None:
    """A process that opens and closes stores (one per engine, as the benchmark's reps do) keeps
    nothing of them: no store thread alive, the host tier's memory freed once the store is dropped."""
    import gc
    import weakref

    freed, others = [], set(threading.enumerate())  # stores other tests left open keep theirs
    for i in range(3):
        store = KVStore(NS, 4096, 64, POLICY, disk=DirSpec(tmp_path / str(i), 1 << 24), write_window_s=0.05)
        for k in keys(4):
            commit(store, k, 1)
        store.load(keys(2), "chat").wait(10)
        store.close()
        freed.append(weakref.ref(store.host.data))
        del store
    gc.collect()
    assert [t.name for t in set(threading.enumerate()) - others if t.name.startswith("deepinfer-kv-")] == []
    assert [ref() is None for ref in freed] == [True] * 3
