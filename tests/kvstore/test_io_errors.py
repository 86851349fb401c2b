"""The store under failing I/O: read errors (EIO, ESTALE, EACCES) are counted misses with every slot
released, tiers fail independently on write (ENOSPC on the local disk still writes the shared tier),
the write-behind thread survives any error, a malformed lease file holds nothing, ``flush`` is bounded,
and ``close`` writes the group-commit window and backlog before it returns."""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path

import pytest

from deepinfer.kvstore.leases import LeaseTable
from deepinfer.kvstore.store import DirSpec, KVStore
from tests.kvstore.test_write_behind import NS, POLICY, commit, keys, tier


def _stored(tmp_path: Path, n: int) -> list[bytes]:
    """``n`` blocks written to a disk tier at ``tmp_path / 'disk'`` and a shared tier at ``tmp_path / 'shared'``."""
    store = KVStore(
        NS,
        256,
        64,
        POLICY,
        disk=DirSpec(tmp_path / "disk", 1 << 20),
        shared=DirSpec(tmp_path / "shared", 1 << 20),
    )
    ks = keys(n)
    for i, key in enumerate(ks):
        commit(store, key, i)
    assert store.close()
    return ks


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.EACCES, errno.EMFILE])
def test_a_read_error_is_a_counted_miss_and_releases_every_slot(tmp_path: Path, code: int) -> None:
    ks = _stored(tmp_path, 6)
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path / "disk", 1 << 20))
    read = store.files[0].read

    def failing(key, now):
        if key == ks[3]:
            raise OSError(code, "injected")
        return read(key, now)

    store.files[0].read = failing
    handle = store.load(ks, "chat")
    assert handle.wait(30) == 3  # the leading blocks before the failing one; the rest is recomputed
    handle.release()
    assert store.flush(30)  # the promoted blocks' write-behind leases end once written
    assert store.host.leases == {}
    assert store.snapshot()["tiers"]["disk"]["read_errors"] == 1
    store.close()


def test_an_unexpected_load_error_never_reaches_the_caller(tmp_path: Path) -> None:
    ks = _stored(tmp_path, 4)
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path / "disk", 1 << 20))
    store.files[0].read = lambda key, now: (_ for _ in ()).throw(RuntimeError("a bug"))
    handle = store.load(ks, "chat")
    assert handle.wait(30) == 0
    handle.release()
    assert store.host.leases == {} and store.snapshot()["load_errors"] == 1
    store.close()


def test_a_full_local_disk_still_writes_the_shared_tier(tmp_path: Path) -> None:
    store = KVStore(
        NS,
        256,
        64,
        POLICY,
        disk=DirSpec(tmp_path / "disk", 1 << 20),
        shared=DirSpec(tmp_path / "shared", 1 << 20),
    )
    disk = next(t for t in store.files if not t.shared)
    disk.write_batch = lambda items, now: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")
    )
    ks = keys(5)
    for i, key in enumerate(ks):
        commit(store, key, i)
    assert store.flush(30)
    snap = store.snapshot()
    assert snap["tiers"]["disk"]["write_errors"] >= 1 and snap["tiers"]["shared"]["writes"] == 5
    assert store.host.leases == {}
    store.close()
    reader = KVStore(NS, 256, 64, POLICY, shared=DirSpec(tmp_path / "shared", 1 << 20))
    assert reader.lookup(ks) == 5
    reader.close()


def test_the_writer_survives_any_error_and_flush_is_bounded(tmp_path: Path) -> None:
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path / "disk", 1 << 20), write_window_s=0)
    write_batch = store.files[0].write_batch
    calls = []

    def once_broken(items, now):
        calls.append(len(items))
        if len(calls) == 1:
            raise ValueError("non-hexadecimal number found in fromhex() arg")  # not an OSError
        write_batch(items, now)

    store.files[0].write_batch = once_broken
    ks = keys(4)
    commit(store, ks[0], 0)
    assert store.flush(30)
    assert store.writer_alive and store.snapshot()["writer_errors"] == 1
    for i, key in enumerate(ks[1:], 1):
        commit(store, key, i)
    assert store.flush(30)
    assert store.close()
    disk = tier(tmp_path / "disk")
    assert [disk.read(k, time.time()) is not None for k in ks] == [False, True, True, True]


def test_flush_does_not_hang_on_a_dead_writer(tmp_path: Path) -> None:
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path / "disk", 1 << 20))
    store._writes.put(None)  # the writer thread ends (as if it had died)
    store._writer.join(10)
    commit(store, keys(1)[0], 1)
    t0 = time.monotonic()
    assert store.flush(None) is False
    assert time.monotonic() - t0 < 5
    assert store.snapshot()["writer_alive"] is False


def test_close_writes_the_group_commit_window_and_records_the_stats(tmp_path: Path) -> None:
    store = KVStore(NS, 256, 64, POLICY, disk=DirSpec(tmp_path / "disk", 1 << 20), write_window_s=3600)
    ks = keys(8)
    for i, key in enumerate(ks):
        commit(store, key, i)
    store.lookup(ks, "agent")
    t0 = time.monotonic()
    assert store.close(30)
    assert time.monotonic() - t0 < 20  # the hour-long window ended at once
    disk = tier(tmp_path / "disk")
    assert all(disk.read(k, time.time()) is not None for k in ks)
    stats = [json.loads(p.read_text()) for p in (tmp_path / "disk").rglob("stats/*.json")]
    assert stats and stats[0]["hits_by_class"] == {"agent": 8}


def test_a_malformed_lease_file_holds_nothing_and_raises_nowhere(tmp_path: Path) -> None:
    table = LeaseTable(tmp_path)
    table.take("h1", [keys(1)[0].hex()], time.time() + 60, "me")
    lease_dir = next(p.parent for p in tmp_path.rglob("*.lease"))
    (lease_dir / "bad.lease").write_text(
        json.dumps({"handoff_id": "bad", "keys": ["zz"], "expires_unix": 1e18, "owner": "x"})
    )
    (lease_dir / "nan.lease").write_text('{"handoff_id": "n", "keys": [], "expires_unix": NaN, "owner": "x"}')
    assert table.held_keys() == {keys(1)[0]}


def test_the_engine_writes_its_store_on_close(tmp_path: Path) -> None:
    from deepinfer import LLM, SamplingParams
    from deepinfer.kvstore.config import KVStoreConfig

    llm = LLM(kv_store=KVStoreConfig(path=str(tmp_path / "kv"), write_window_ms=3_600_000), max_model_len=512)
    llm.generate(["def read_config(path):\n    " * 8], SamplingParams(max_tokens=2))
    store = llm.engine.kv_connector.store
    assert store.snapshot()["tiers"]["host"]["entries"] > 0
    llm.close()
    assert not store.writer_alive
    packs = list((tmp_path / "kv").rglob("*.kvp"))
    assert packs, "the hour-long group-commit window was lost on close"
