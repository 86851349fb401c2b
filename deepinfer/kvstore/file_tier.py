"""The shared tier: a directory of write-once, checksummed files, one per block.

A directory on a shared filesystem mount such as 3FS, NFS, CephFS or JuiceFS that many engine
processes on many hosts read and write at once: one file per block, so that any process finds a block
another wrote by its key (the local disk tier, which one process owns, packs each batch into one file
instead: ``pack_tier``). Layout: ``ROOT/kv1/<namespace hex[:32]>/<key hex[:2]>/<key hex>.kvb`` plus
``NAMESPACE.json`` describing the namespace. Retention metadata lives in the file times: mtime =
expiry, atime = last use (set explicitly; both are updated in place without rewriting content).
``shared=False`` (tests, tools) skips looking for other writers' files.

Crash safety: a record is written to a temporary file (``O_EXCL``, unique name per writer), fsynced,
then hard-linked to its final name (``link`` never replaces: the first writer wins, a loser just
drops its temporary file), and each directory fsynced once per batch (network and FUSE filesystems
define durability per file; a key sub-directory this process first uses is made durable by an fsync of
the namespace folder too), so a name never points at bytes that are not on disk. A reader
therefore sees no file or a complete one; what a crash leaves is a temporary file, never served and
collected after ``STALE_TMP_S``. Every read verifies the record (``record.decode``); a bad one is a
miss that is counted, logged once per tier and reason, and removed. The index is rebuilt from the
directory at start. Thread safety: the index is guarded by ``lock``, held only around index changes,
never during file I/O, so a lookup from the engine thread never waits for an fsync.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from deepinfer.kvstore import record
from deepinfer.kvstore.leases import LeaseTable
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.retention import Entry, RetentionPolicy, expired, plan_eviction
from deepinfer.logger import get_logger

logger = get_logger(__name__)

STALE_TMP_S = 600.0  # a temporary file older than this belongs to a writer that died
SUFFIX = ".kvb"


class FileTier:
    def __init__(
        self,
        name: str,
        root: Path,
        namespace: bytes,
        namespace_info: dict,
        capacity_bytes: int,
        shared: bool,
        policy: RetentionPolicy,
        counters: TierCounters,
        clock: Callable[[], float],
    ) -> None:
        self.name = name
        self.dir = namespace_dir(root, namespace)
        self.namespace = namespace
        self.capacity = capacity_bytes
        self.shared = shared
        self.policy = policy
        self.counters = counters
        self.clock = clock
        self.index: dict[bytes, Entry] = {}
        self.used = 0
        self._logged: set[str] = set()
        self._subdirs: set[str] = set()  # key sub-directories known to exist
        self._new_subdir = False  # a sub-directory first used since the namespace folder's last fsync
        self.lock = threading.RLock()
        self.held: set[bytes] = set()  # keys under a store hold: never evicted
        self.leases = LeaseTable(root) if shared else None  # handoff leases: never evicted either
        make_dirs(self.dir)
        info = self.dir / "NAMESPACE.json"
        if not info.is_file():
            write_atomic(info, json.dumps(namespace_info, indent=1, sort_keys=True).encode())
        self.rescan()

    # ------------------------------------------------------------------ index
    def path(self, key: bytes) -> Path:
        return block_path(self.dir, key)

    def rescan(self) -> None:
        """Rebuild the index from the directory: every final file (sizes below a header are removed
        as corrupt), and stale temporary files deleted."""
        now = self.clock()
        index: dict[bytes, Entry] = {}
        for sub in self.dir.iterdir():
            if not sub.is_dir() or sub.name == "stats":
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp."):
                    if now - st.st_mtime > STALE_TMP_S and st.st_mtime <= now:
                        _unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                if st.st_size < record.HEADER_SIZE:
                    self._corrupt(key, "empty" if st.st_size == 0 else "truncated", Path(entry.path))
                    continue
                index[key] = Entry(key, st.st_size, st.st_atime, st.st_mtime)
        with self.lock:
            self.index = index
            self.used = sum(e.size for e in index.values())
            self._gauges()

    def _known(self, key: bytes) -> Entry | None:
        entry = self.index.get(key)
        if entry is None and self.shared:  # another process may have written it
            try:
                st = self.path(key).stat()
            except FileNotFoundError:
                return None
            entry = Entry(key, st.st_size, st.st_atime, st.st_mtime)
            with self.lock:
                if key not in self.index:
                    self.index[key] = entry
                    self.used += entry.size
        return entry

    def contains(self, key: bytes, now: float) -> bool:
        entry = self._known(key)
        return entry is not None and entry.expires_at > now

    # ------------------------------------------------------------------ read
    def read(self, key: bytes, now: float) -> memoryview | None:
        """The verified payload of ``key``, or None (missing, expired or bad: bad files are removed)."""
        entry = self._known(key)
        if entry is None or entry.expires_at <= now:
            return None
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self._drop(key)
            return None
        try:
            payload = record.decode(raw, key, self.namespace)
        except record.RecordError as e:
            with self.lock:
                self._corrupt(key, e.reason, path)
            return None
        with self.lock:
            self.counters.hits += 1
            self.counters.bytes_read += len(raw)
        return payload

    def touch(self, key: bytes, now: float, cls: str) -> None:
        """A hit or a repeated save: last use = now, expiry extended for ``cls`` (never shortened)."""
        with self.lock:
            entry = self.index.get(key)
            if entry is None or entry.expires_at <= now:  # an expired entry is never revived
                return
            entry.last_used = now
            entry.expires_at = self.policy.expiry(entry.expires_at, now, cls)
            times = (now, entry.expires_at)
        try:
            os.utime(self.path(key), times)
        except FileNotFoundError:
            self._drop(key)

    # ------------------------------------------------------------------ write
    def write_batch(self, items: list[tuple[bytes, bytes | memoryview, str]], now: float) -> None:
        """Write (key, payload, class) records; keys already present are only touched. Durable when
        this returns: every new record goes to its own fsynced temporary file, then is linked to its
        name; then each directory that gained a name is fsynced."""
        staged: list[tuple[bytes, str, str, int, float]] = []  # key, tmp, final path, size, expiry
        tag = f"{os.getpid()}.{secrets.token_hex(4)}"  # this batch's temporary-name suffix
        try:
            new, seen = [], set()
            for key, payload, cls in items:
                if self._known(key) is not None:
                    self.touch(key, now, cls)
                elif key not in seen:
                    seen.add(key)
                    new.append((key, payload, cls))
            with self.lock:  # room for the whole batch at once: the common case, one eviction pass
                whole = self._make_room(sum(record.HEADER_SIZE + len(p) for _, p, _ in new), now)
            staged_bytes = 0
            for key, payload, cls in new:
                size = record.HEADER_SIZE + len(payload)
                if not whole:
                    with self.lock:  # room for this record and those staged before it
                        if not self._make_room(size + staged_bytes, now):
                            continue
                path = self._final_path(key)
                expiry = self.policy.expiry(None, now, cls)
                header = record.encode_header(key, self.namespace, payload, now, cls)
                folder, name = os.path.split(path)
                tmp = os.path.join(folder, f".tmp.{name}.{tag}")
                _write_tmp(tmp, header, payload, now, expiry)
                staged.append((key, tmp, path, size, expiry))
                staged_bytes += size
            dirs: set[str] = set()
            linked = [
                (key, path, size, expiry, _link_once(tmp, path)) for key, tmp, path, size, expiry in staged
            ]
            staged = []
            with self.lock:
                for key, path, size, expiry, won in linked:
                    if won:
                        self.counters.writes += 1
                        self.counters.bytes_written += size
                        dirs.add(os.path.dirname(path))
                    if key not in self.index:
                        self.index[key] = Entry(key, size, now, expiry)
                        self.used += size
                self._gauges()
            if dirs and self._new_subdir:
                dirs.add(str(self.dir))
            for d in dirs:
                fsync_dir(d)
            if str(self.dir) in dirs:
                self._new_subdir = False
        finally:
            for _, tmp, _, _, _ in staged:  # an error before linking: no temporary file is left
                _unlink(tmp)

    def _final_path(self, key: bytes) -> str:
        """``path(key)`` as a string, its sub-directory created on first use."""
        h = key.hex()
        sub = os.path.join(self.dir, h[:2])
        if sub not in self._subdirs:
            os.makedirs(sub, exist_ok=True)
            self._subdirs.add(sub)
            self._new_subdir = True  # its entry in the namespace folder is durable once that is synced
        return os.path.join(sub, h + SUFFIX)

    def close(self) -> None:
        """Nothing to finish: every write and touch is on disk when its call returns."""

    # ------------------------------------------------------------------ retention
    def _make_room(self, incoming: int, now: float) -> bool:
        if self.used + incoming <= 0.95 * self.capacity:
            return True
        if self.shared:
            self.rescan()  # other writers changed the directory: plan on what is really there
        held = self.held | self.leases.held_keys(now) if self.leases is not None else self.held
        entries = [
            Entry(e.key, e.size, e.last_used, e.expires_at, e.key in held) for e in self.index.values()
        ]
        victims, fits = plan_eviction(entries, now, self.capacity, incoming)
        for key in victims:
            expired_now = self.index[key].expires_at <= now
            self.remove(key)
            if expired_now:
                self.counters.expirations += 1
            else:
                self.counters.evictions += 1
        return fits

    def collect(self, now: float) -> int:
        """Remove every expired entry; returns how many."""
        with self.lock:
            keys = expired(self.index.values(), now)
            for key in keys:
                self.remove(key)
            self.counters.expirations += len(keys)
            self._gauges()
        return len(keys)

    def remove(self, key: bytes) -> None:
        _unlink(self.path(key))
        self._drop(key)

    def _drop(self, key: bytes) -> None:
        with self.lock:
            entry = self.index.pop(key, None)
            if entry is not None:
                self.used -= entry.size
                self._gauges()

    def _corrupt(self, key: bytes, reason: str, path: Path) -> None:
        self.counters.corrupt_reads += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning(
                "kv store %s: %s is bad (%s); treated as a miss and removed", self.name, path, reason
            )
        _unlink(path)
        self._drop(key)

    def _gauges(self) -> None:
        self.counters.entries = len(self.index)
        self.counters.bytes = self.used


def namespace_dir(root: str | Path, namespace: bytes) -> Path:
    """The folder of ``namespace``'s blocks in the tier rooted at ``root``."""
    return Path(root) / "kv1" / namespace.hex()[:32]


def block_path(folder: Path, key: bytes) -> Path:
    """Where block ``key`` lives in a namespace folder (its file exists once it is written whole)."""
    h = key.hex()
    return folder / h[:2] / (h + SUFFIX)


def _write_tmp(tmp: str, header: bytes, payload: bytes | memoryview, now: float, expiry: float) -> None:
    """Create ``tmp`` (exclusive) holding ``header`` + ``payload``, times (last use, expiry), and
    fsync it; on any error the file is removed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(payload).cast("B")
        written = os.writev(fd, [header, view])
        rest = written - len(header)
        if rest < 0:  # a short write (rare on regular files): finish the header, then the payload
            os.write(fd, header[written:])
            rest = 0
        view = view[rest:]
        while view:
            view = view[os.write(fd, view) :]
        os.utime(fd, (now, expiry))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)


def _link_once(tmp: str, path: str) -> bool:
    """Give the durable ``tmp`` its final name unless the name exists (the first writer wins: its
    bytes are the same block); ``tmp`` is removed either way."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        _unlink(tmp)


def write_atomic(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data`` unless it exists (first writer wins), durably."""
    tmp = path.parent / f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        _unlink(tmp)
    fsync_dir(path.parent)


def make_dirs(path: str | Path) -> None:
    """Create the folder ``path`` and its missing parents durably: each parent that gained an entry
    is fsynced (else a crash could take a folder, and the records in it, away)."""
    missing = []
    folder = Path(path)
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it: sync the entry anyway
            os.mkdir(folder)
        fsync_dir(folder.parent)


def _unlink(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory (its entries are durable); filesystems that refuse it (EINVAL, ENOTSUP) are let be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (and FUSE mounts) refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
