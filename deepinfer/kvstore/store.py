"""The tiered KV store: batched lookup, asynchronous batched load and save, leases, write-behind.

One ``KVStore`` per pool and namespace (see ``keys.StoreNamespace``), created by the engine's
connector (or by a tool such as a prefill/decode handoff). Tiers, fastest first: ``host`` (a slot
pool in host memory, always present: it is where loads land and saves start), ``disk``
(``PackTier``: a local directory, one pack file per write-behind batch) and ``shared``
(``FileTier``: a shared mount, one file per block), each optional and sized by the user. A key is served by the
fastest tier holding it; a load from a file tier promotes the block into host memory; a save commits
into host memory and is written behind (a background thread, batched over a group-commit window
when only a local disk is written, with a bounded backlog whose overflow stays in host memory,
counted in ``writes_dropped``) to disk and shared. Blocks are bytes:
``slot_bytes`` per block, laid out by the caller (the connector copies each cache layer's block
tensors into its slot in a fixed order that ``keys.LAYOUT_VERSION`` names).

Nothing here blocks the engine step: ``lookup`` reads in-memory indexes (and, for the shared tier,
stats a file for keys it has not seen); ``load`` returns a ``LoadHandle`` at once and reads files on
the loader thread; ``commit`` queues the write. Leases: a slot being filled or read is leased (never
evicted), and ``hold(keys, seconds)`` keeps a request's entries from eviction until released or
expired, which is how a prefill worker keeps blocks for the decode worker it hands their keys to.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.kvstore.file_tier import FileTier
from deepinfer.kvstore.host_tier import HostTier
from deepinfer.kvstore.keys import StoreNamespace
from deepinfer.kvstore.metrics import StoreMetrics
from deepinfer.kvstore.owner import OwnerLock
from deepinfer.kvstore.pack_tier import PackTier
from deepinfer.kvstore.retention import RetentionPolicy
from deepinfer.logger import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DirSpec:
    """A file tier: a directory and its capacity in bytes."""

    path: Path
    capacity_bytes: int


class LoadHandle:
    """An asynchronous load of leading blocks into host slots (created by ``KVStore.load``).

    When ``done()``, ``slots[i]`` holds block ``keys[i]`` for ``i < num_loaded`` (a key found bad or
    missing ends the prefix there); each of those slots is leased until ``release()``.
    """

    def __init__(self, store: KVStore, keys: list[bytes], future: Future[list[int]]) -> None:
        self._store = store
        self.keys = keys
        self._future = future
        self.started = time.perf_counter()
        self._released = False

    def done(self) -> bool:
        return self._future.done()

    @property
    def slots(self) -> list[int]:
        return self._future.result()

    @property
    def num_loaded(self) -> int:
        return len(self.slots)

    def wait(self, timeout: float | None = None) -> int:
        return len(self._future.result(timeout))

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._store._release(self._future.result())


class KVStore:
    READ_THREADS = 4  # file reads in flight per load

    def __init__(
        self,
        namespace: StoreNamespace,
        slot_bytes: int,
        host_slots: int,
        policy: RetentionPolicy,
        disk: DirSpec | None = None,
        shared: DirSpec | None = None,
        pin_memory: bool = False,
        clock: Callable[[], float] = time.time,
        max_pending_writes: int = 4096,
        write_window_s: float = 0.0,
    ) -> None:
        """``max_pending_writes``: the write-behind backlog, in blocks (each leases its host slot
        until written); a save past it stays in host memory only and is counted in
        ``writes_dropped``: the engine never waits for the disk. ``write_window_s``: how long the
        writer gathers saves into one batch (one durable sync for all of them) when only a local
        disk tier is written; with a shared tier each batch is written as soon as it is queued (the
        prefill/decode handoff waits for those files)."""
        self.namespace = namespace
        self.ns_digest = namespace.digest()
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.clock = clock
        self.metrics = StoreMetrics()
        self._lock = threading.RLock()  # guards the host tier, holds and metrics
        self.host = HostTier(host_slots, slot_bytes, pin_memory, policy, self.metrics.tier("host"), clock)
        self.files: list[PackTier | FileTier] = []
        self._owner: OwnerLock | None = None
        if disk is not None:  # one pack file per write-behind batch (this process owns the folder)
            self._owner = OwnerLock(disk.path)  # a second owner of the folder fails here, at once
            self.files.append(
                PackTier(
                    "disk",
                    disk.path,
                    self.ns_digest,
                    namespace.describe(),
                    disk.capacity_bytes,
                    policy,
                    self.metrics.tier("disk"),
                    clock,
                )
            )
        if shared is not None:  # one file per block (other processes find blocks by key)
            self.files.append(
                FileTier(
                    "shared",
                    shared.path,
                    self.ns_digest,
                    namespace.describe(),
                    shared.capacity_bytes,
                    True,
                    policy,
                    self.metrics.tier("shared"),
                    clock,
                )
            )
        self._holds: dict[int, tuple[list[bytes], list[int], float]] = {}
        self._hold_ids = itertools.count(1)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-load")
        self._readers = ThreadPoolExecutor(self.READ_THREADS, thread_name_prefix="deepinfer-kv-read")
        # batches of (key, slot or None for a touch, class) for the writer thread; None stops it
        self._writes: queue.Queue[list[tuple[bytes, int | None, str]] | None] = queue.Queue()
        self._host_rows = self.host.data.numpy()  # [slots, slot_bytes] view the writer reads from
        if max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be at least 1, got {max_pending_writes}")
        self.max_pending_writes = max_pending_writes
        if write_window_s < 0:
            raise ValueError(f"write_window_s must be at least 0, got {write_window_s}")
        self.write_window_s = 0.0 if shared is not None else write_window_s
        self._flushers = 0  # flush calls waiting: the writer skips its window
        self._hurry = threading.Event()  # ends the writer's window early
        self._pending = 0  # queued items (writes and touches), for flush
        self._pending_writes = 0  # queued block writes, bounded by max_pending_writes
        self._idle = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="deepinfer-kv-write", daemon=True)
        self._writer.start()
        self._closed = False
        self._logged_errors: set[tuple[str, str, str]] = set()
        self._last_collect = clock()

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes], cls: str | None = None) -> int:
        """How many leading ``keys`` some tier holds, unexpired (host first, then disk, shared)."""
        now = self.clock()
        found = 0
        with self._lock:
            for key in keys:
                if self.host.get(key, now) is None and not any(t.contains(key, now) for t in self.files):
                    break
                found += 1
            m = self.metrics
            m.lookups += 1
            m.lookup_blocks += len(keys)
            m.hit_blocks += found
            m.misses += found < len(keys)
            if found and cls is not None:
                m.hits_by_class[cls] = m.hits_by_class.get(cls, 0) + found
        return found

    # ------------------------------------------------------------------ load
    def load(self, keys: Sequence[bytes], cls: str) -> LoadHandle:
        """Start loading ``keys`` (leading blocks) into leased host slots; returns at once."""
        keys = list(keys)
        return LoadHandle(self, keys, self._loader.submit(self._load, keys, cls))

    def _load(self, keys: list[bytes], cls: str) -> list[int]:
        """The leading blocks of ``keys`` loaded into leased host slots (a prefix of ``keys``). Never
        raises: a failure ends the prefix there (the engine recomputes the rest) and is counted."""
        slots: list[int] = []
        try:
            return self._load_into(keys, cls, slots)
        except Exception:  # a bug or an unexpected error must not reach the engine step
            logger.exception(
                "kv store: loading %d blocks failed; %d loaded, the rest recomputed", len(keys), len(slots)
            )
            with self._lock:
                self.metrics.load_errors += 1
            return slots

    def _load_into(self, keys: list[bytes], cls: str, slots: list[int]) -> list[int]:
        start = time.perf_counter()
        now = self.clock()
        with self._lock:
            in_host = [self.host.get(key, now) is not None for key in keys]
        # Files are read ahead on the reader threads (reads release the GIL), consumed in order.
        reads = {
            i: self._readers.submit(self._read_files, key, now, cls)
            for i, key in enumerate(keys)
            if not in_host[i]
        }
        promoted = []
        try:
            for i, key in enumerate(keys):
                with self._lock:
                    slot = self.host.get(key, now)
                    if slot is not None:
                        self.host.lease(slot)
                        self.host.touch(key, now, cls)
                        self.metrics.tier("host").hits += 1
                        self.metrics.tier("host").bytes_read += self.slot_bytes
                if slot is not None:
                    for tier in self.files:  # the hit extends the files' expiry too
                        tier.touch(key, now, cls)
                    slots.append(slot)
                    continue
                payload = reads[i].result() if i in reads else self._read_files(key, now, cls)
                if payload is None or len(payload) != self.slot_bytes:
                    break
                with self._lock:
                    slot = self.host.reserve(now)
                    if slot is None:
                        self.metrics.saves_refused += 1
                        break
                self.host.data[slot].numpy()[:] = memoryview(payload).cast("B")
                with self._lock:
                    if not self.host.commit(key, slot, now, cls):  # someone promoted it meanwhile
                        self.host.release(slot)
                        slot = self.host.get(key, now)
                        if slot is None:
                            break
                        self.host.lease(slot)
                    else:
                        promoted.append((key, slot))
                slots.append(slot)
        finally:
            for future in reads.values():
                future.cancel()
        with self._lock:
            self.metrics.observe_load(time.perf_counter() - start)
        if promoted and self.files:  # write behind to the tiers that lack it (touches the others)
            with self._lock:
                for _, slot in promoted:
                    self.host.lease(slot)  # the writer's lease, until written
                self._queue_writes([(key, slot, cls) for key, slot in promoted])
        return slots

    def _read_files(self, key: bytes, now: float, cls: str) -> memoryview | None:
        """The verified payload from the fastest file tier holding ``key`` (its expiry extended). A
        tier whose read fails with an I/O error (EIO, EACCES, EMFILE, ESTALE, ...) is a counted miss
        there; the next tier is tried."""
        for tier in self.files:
            try:
                payload = tier.read(key, now)
                if payload is not None:
                    tier.touch(key, now, cls)
                    return payload
            except OSError as exc:
                self._io_error(tier, "read_errors", f"reading block {key.hex()[:16]}", exc)
        return None

    def _io_error(self, tier, counter: str, what: str, exc: BaseException) -> None:
        """Count an I/O error of ``tier`` under ``counter`` and log the first of each kind."""
        name = "shared" if tier.shared else "disk"
        with self._lock:
            counters = self.metrics.tier(name)
            setattr(counters, counter, getattr(counters, counter) + 1)
            first = (name, counter, type(exc).__name__) not in self._logged_errors
            self._logged_errors.add((name, counter, type(exc).__name__))
        if first:
            logger.warning("kv store: %s tier failed %s (%s: %s); counted as a miss from now on, logged once",
                           name, what, type(exc).__name__, exc)  # fmt: skip

    def _release(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self.host.release(slot)

    def slot(self, slot: int) -> torch.Tensor:
        """The ``[slot_bytes]`` uint8 host buffer of a slot (read after a load, written before commit)."""
        return self.host.data[slot]

    # ------------------------------------------------------------------ save
    def has(self, key: bytes) -> bool:
        """True when the host tier holds ``key`` (a save of it would only touch)."""
        with self._lock:
            return self.host.get(key, self.clock()) is not None

    def reserve(self) -> int | None:
        """A leased host slot to copy a block into, then ``commit`` (or ``abandon``); None when every
        slot is leased (the save is dropped and counted)."""
        slots = self.reserve_many(1)
        return slots[0] if slots else None

    def reserve_many(self, n: int) -> list[int]:
        """Up to ``n`` reservations (``reserve``'s, under one lock), ascending so that a fresh run of
        slots is contiguous; fewer when slots run out (each save missing is counted refused)."""
        with self._lock:
            now = self.clock()
            slots = []
            for _ in range(n):
                slot = self.host.reserve(now)
                if slot is None:
                    self.metrics.saves_refused += n - len(slots)
                    break
                slots.append(slot)
            return sorted(slots)

    def abandon(self, slot: int) -> None:
        with self._lock:
            self.host.release(slot)

    def save_existing(self, key: bytes, cls: str) -> bool:
        """A save of a block the host tier already holds: touch it for ``cls``. False if absent."""
        now = self.clock()
        with self._lock:
            if self.host.get(key, now) is None:
                return False
            self.host.touch(key, now, cls)
            if self.files:
                self._pending += 1
                self._writes.put([(key, None, cls)])  # the writer extends the files' expiry
            return True

    def commit(self, key: bytes, slot: int, cls: str) -> None:
        """``commit_many`` of one block."""
        self.commit_many([(key, slot, cls)])

    def commit_many(self, items: Sequence[tuple[bytes, int, str]]) -> None:
        """Publish filled slots, ``(key, slot, class)`` each, as their keys (ends each reservation's
        lease) and queue them, as one batch, to be written behind to the file tiers. A key another
        save committed first is only touched; with ``max_pending_writes`` blocks already queued, a
        block stays in host memory only (counted in ``writes_dropped``)."""
        now = self.clock()
        with self._lock:
            queued = []
            for key, slot, cls in items:
                if not self.host.commit(key, slot, now, cls):
                    self.host.release(slot)
                    self.host.touch(key, now, cls)
                elif self.files:
                    queued.append((key, slot, cls))  # the reservation's lease passes to the writer
                else:
                    self.host.release(slot)
            self._queue_writes(queued)

    def _queue_writes(self, items: list[tuple[bytes, int, str]]) -> None:
        """Hand committed, writer-leased slots to the writer thread as one batch, up to the backlog
        bound; the rest are released unwritten and counted. Call with the lock held."""
        room = max(self.max_pending_writes - self._pending_writes, 0)
        for _, slot, _ in items[room:]:
            self.host.release(slot)
        self.metrics.writes_dropped += max(len(items) - room, 0)
        items = items[:room]
        if not items:
            return
        self._pending += len(items)
        self._pending_writes += len(items)
        self._writes.put(items)
        if self._pending_writes * 2 >= self.max_pending_writes:
            self._hurry.set()

    def _next_batch(self) -> list[tuple[bytes, int | None, str]] | None:
        """The writer's next batch (None: stop): once something is queued, the writer sleeps out
        ``write_window_s`` (group commit: one wake-up and one pair of syncs per window rather than
        per engine step; ``flush``, ``close`` or a half-full backlog end it at once), then takes
        everything queued."""
        first = self._writes.get()
        if first is None:
            return None
        if self.write_window_s > 0 and not self._hurried():
            self._hurry.wait(self.write_window_s)
        self._hurry.clear()
        batch = list(first)
        while True:
            try:
                more = self._writes.get_nowait()
            except queue.Empty:
                return batch
            if more is None:
                self._writes.put(None)
                return batch
            batch += more

    def _hurried(self) -> bool:
        with self._lock:
            return self._flushers > 0 or self._pending_writes * 2 >= self.max_pending_writes

    def _write_loop(self) -> None:
        """The write-behind thread: one batch at a time into every file tier. Tiers fail independently
        (a full local disk still writes the shared tier, and the other way round), each failure
        counted per tier; an unexpected error is counted and logged, and the thread goes on. A failed
        batch stays in host memory only. Its slots are released whatever happens."""
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                now = self.clock()
                # the slots are leased to this thread: their rows are written from in place
                items = [(k, self._host_rows[s].data, c) for k, s, c in batch if s is not None]
                for tier in self.files:
                    try:
                        for key, slot, cls in batch:
                            if slot is None:
                                tier.touch(key, now, cls)
                        tier.write_batch(items, now)
                    except OSError as exc:  # a full or failing disk: this tier misses the batch
                        self._io_error(tier, "write_errors", f"writing {len(items)} blocks", exc)
            except Exception:
                logger.exception("kv store: the write-behind failed on %d blocks; it goes on", len(batch))
                with self._lock:
                    self.metrics.writer_errors += 1
            finally:
                with self._lock:
                    writes = 0
                    for _, slot, _ in batch:
                        if slot is not None:
                            self.host.release(slot)
                            writes += 1
                    self._pending -= len(batch)
                    self._pending_writes -= writes
                    self._idle.notify_all()

    @property
    def writer_alive(self) -> bool:
        """Whether the write-behind thread runs (False after it died, or once the store is closed)."""
        return self._writer.is_alive()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is durable (the writer's window ends at once); False on
        timeout, or at once if the writer is no longer running (nothing would write them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            self._flushers += 1
            self._hurry.set()  # a writer sleeping out its window writes now
            try:
                while self._pending:
                    if not self._writer.is_alive():
                        return False
                    left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                    if left <= 0:
                        return False
                    self._idle.wait(left)
                return True
            finally:
                self._flushers -= 1

    # ------------------------------------------------------------------ holds (leases with expiry)
    def hold(self, keys: Sequence[bytes], seconds: float) -> int:
        """Keep ``keys``' host entries (those present) and files from eviction for ``seconds`` or
        until ``unhold``; returns the hold id. Expired holds are dropped by ``collect``."""
        now = self.clock()
        with self._lock:
            slots = []
            for key in keys:
                slot = self.host.get(key, now)
                if slot is not None:
                    self.host.lease(slot)
                    slots.append(slot)
            hold_id = next(self._hold_ids)
            self._holds[hold_id] = (list(keys), slots, now + seconds)
            self._sync_held()
            return hold_id

    def unhold(self, hold_id: int) -> None:
        with self._lock:
            entry = self._holds.pop(hold_id, None)
            if entry is not None:
                for slot in entry[1]:
                    self.host.release(slot)
                self._sync_held()

    def _sync_held(self) -> None:
        held = {k for keys, _, _ in self._holds.values() for k in keys}
        for tier in self.files:
            tier.held = held

    # ------------------------------------------------------------------ upkeep
    def collect(self) -> int:
        """Drop expired holds and collect expired entries in every tier; returns entries removed."""
        now = self.clock()
        with self._lock:
            for hold_id in [h for h, (_, _, until) in self._holds.items() if until <= now]:
                self.unhold(hold_id)
            removed = self.host.collect(now)
        for tier in self.files:
            if tier.shared:
                tier.rescan()
            removed += tier.collect(now)
        self._record_stats()
        return removed

    COLLECT_INTERVAL_S = 60.0

    def maybe_collect(self) -> None:
        """Every ``COLLECT_INTERVAL_S``: collect expired entries on the loader thread (never here)."""
        now = self.clock()
        if now - self._last_collect >= self.COLLECT_INTERVAL_S:
            self._last_collect = now
            self._loader.submit(self.collect)

    def _record_stats(self) -> None:
        """Write this process's counters into each file tier's ``stats/`` (for ``deepinfer kvstore stats``)."""
        data = json.dumps(self.snapshot()).encode()
        name = f"{socket.gethostname()}-{os.getpid()}.json"
        for tier in self.files:
            folder = tier.dir / "stats"
            folder.mkdir(exist_ok=True)
            tmp = folder / f".tmp.{name}"
            tmp.write_bytes(data)
            os.replace(tmp, folder / name)

    def snapshot(self) -> dict:
        with self._lock:
            self.metrics.writer_alive = self._closed or self._writer.is_alive()
            return self.metrics.snapshot()

    def close(self, timeout: float = 30.0) -> bool:
        """Write what is queued (within ``timeout`` seconds), record the stats and stop the threads;
        False (logged, with the blocks left unwritten) if the writes did not finish in time."""
        if self._closed:
            return True
        self._closed = True
        written = self.flush(timeout)
        if not written:
            with self._lock:
                left = self._pending_writes
            logger.warning(
                "kv store: closing with %d blocks not written within %g s (kept nowhere)", left, timeout
            )
        self._writes.put(None)
        self._hurry.set()
        self._writer.join(timeout if not written else None)
        self._loader.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for tier in self.files:
            tier.close()
        try:
            self._record_stats()
        except OSError as exc:
            logger.warning("kv store: could not record its stats on close (%s)", exc)
        if self._owner is not None:
            self._owner.release()
        return written
