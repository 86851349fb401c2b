"""The local disk tier: each write-behind batch is one write-once, checksummed *pack* file.

One engine process owns a disk tier directory (a shared mount is ``file_tier.FileTier``'s, one file
per block, so that other processes find a block by its key). Writing one file per block cost ~0.2 ms
of CPU per block here (inode and directory updates, journal), which an engine at full load pays out
of its forward passes; a pack per batch costs one file creation, one ``writev``, one ``fsync`` and
one rename for the whole batch.

Layout: ``ROOT/kv1/<namespace hex[:32]>/packs/<unique name>.kvp``. A pack is the batch's block
records (``record``: 128-byte header with its own checksums, then the payload), then a trailer: one
72-byte entry per block (key, offset, record length, last use, expiry) and per *touch* (key, last
use, expiry of a block the batch only extended, stored in an older pack), then a 64-byte footer
(magic ``DIKVPACK``, version, entry count, namespace digest, entries' length, xxh3-64 of the
entries and the footer before it). A block's retention state is the newest of its data entry and
its touch entries (expiry never shortens, so the newest dominates).

Crash safety: a pack is written to a temporary file (``O_EXCL``, unique name), fsynced, renamed to
its unique final name, and the directory fsynced (the folders themselves were created durably,
``file_tier.make_dirs``), so a pack under a final name is whole and durable;
a crash leaves a temporary file, never served and collected after ``STALE_TMP_S``. The index is
rebuilt at start from the trailers alone (no payload is read): a pack with a bad trailer (truncated,
empty, another namespace, flipped bits) is counted, logged once and removed. Every read verifies its
record (``record.decode``); a bad record is a counted miss and its whole pack is removed (the tier is
a cache: its other blocks become misses, never wrong KV). Per-block files of the previous disk
format (``<key hex[:2]>/<key>.kvb``) found at start are counted as ``version`` misses and removed.
Touches made since the last pack (hits) are written with the next batch or at ``close``; a crash
loses at most those extensions (an expiry then comes earlier, never later).

Space: a pack stays on disk while any of its blocks is indexed there or it holds the newest touch of
an indexed block; ``used`` is the bytes of the packs on disk. Capacity eviction removes whole packs
(expired first, then least recently used by their blocks' newest use); held blocks keep their pack.
Thread safety: ``lock`` guards the index, held around index changes (and the unlinks of evicted
packs), never while a pack is read, written or synced.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from deepinfer.kvstore import record
from deepinfer.kvstore.file_tier import STALE_TMP_S, fsync_dir, make_dirs, namespace_dir, write_atomic
from deepinfer.kvstore.file_tier import SUFFIX as BLOCK_SUFFIX
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.retention import Entry, RetentionPolicy, plan_eviction
from deepinfer.logger import get_logger

logger = get_logger(__name__)

SUFFIX = ".kvp"
PACK_MAGIC = b"DIKVPACK"
PACK_VERSION = 1
ENTRY = struct.Struct("<32sQQddB7x")  # key, offset, record length, last use, expiry, kind
FOOTER = struct.Struct("<8sHHI32sQ")  # magic, version, 0, entry count, namespace, entries' length
FOOTER_SIZE = FOOTER.size + 8  # then xxh3-64 of the entries and the footer before it
DATA, TOUCH = 0, 1
MAX_IOV = 1000  # buffers per writev call (the kernel's IOV_MAX is 1024)


class PackError(ValueError):
    """A pack whose trailer must not be trusted. ``reason``: empty, truncated, magic, version,
    namespace, checksum, bounds."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PackEntry:
    key: bytes
    offset: int  # of the block record (0 for a touch)
    length: int  # record bytes, header included (0 for a touch)
    last_used: float
    expires_at: float
    kind: int  # DATA or TOUCH


def encode_trailer(entries: list[PackEntry], namespace: bytes) -> bytes:
    body = b"".join(ENTRY.pack(e.key, e.offset, e.length, e.last_used, e.expires_at, e.kind) for e in entries)
    footer = FOOTER.pack(PACK_MAGIC, PACK_VERSION, 0, len(entries), namespace, len(body))
    return body + footer + struct.pack("<Q", xxhash.xxh3_64_intdigest(body + footer))


def read_trailer(fd: int, size: int, namespace: bytes | None) -> list[PackEntry]:
    """The entries of the pack open at ``fd`` (``size`` bytes), after checking its footer, checksum,
    namespace (when given) and that every record lies before the trailer."""
    if size == 0:
        raise PackError("empty", "zero-length pack")
    if size < FOOTER_SIZE:
        raise PackError("truncated", f"{size} bytes, shorter than the {FOOTER_SIZE}-byte footer")
    tail = os.pread(fd, FOOTER_SIZE, size - FOOTER_SIZE)
    magic, version, _, count, ns, body_len = FOOTER.unpack_from(tail)
    if magic != PACK_MAGIC:
        raise PackError("magic", f"magic {magic!r} is not a deepinfer KV pack")
    if version != PACK_VERSION:
        raise PackError("version", f"pack version {version}, expected {PACK_VERSION}")
    if body_len != count * ENTRY.size or body_len > size - FOOTER_SIZE:
        raise PackError("truncated", f"{count} entries do not fit in {size} bytes")
    body = os.pread(fd, body_len, size - FOOTER_SIZE - body_len)
    (checksum,) = struct.unpack_from("<Q", tail, FOOTER.size)
    if xxhash.xxh3_64_intdigest(body + tail[: FOOTER.size]) != checksum:
        raise PackError("checksum", "trailer checksum mismatch")
    if namespace is not None and ns != namespace:
        raise PackError("namespace", "written under another model, tokenizer or KV layout")
    records_end = size - FOOTER_SIZE - body_len
    out = [PackEntry(*ENTRY.unpack_from(body, i * ENTRY.size)) for i in range(count)]
    for e in out:
        if e.kind == DATA and (e.length < record.HEADER_SIZE or e.offset + e.length > records_end):
            raise PackError("bounds", f"a record at {e.offset}+{e.length} lies past {records_end}")
    return out


@dataclass(slots=True)
class PackScan:
    """What a folder of packs holds (``scan``): per key its newest state over every pack."""

    sizes: dict[str, int] = field(default_factory=dict)  # good pack -> bytes
    bad: list[tuple[str, str, str]] = field(default_factory=list)  # (path, reason, detail)
    temporary: list[tuple[str, float]] = field(default_factory=list)  # (path, mtime)
    location: dict[bytes, tuple[str, int, int, float]] = field(
        default_factory=dict
    )  # pack, offset, length, expiry
    last_used: dict[bytes, float] = field(default_factory=dict)
    expires_at: dict[bytes, float] = field(default_factory=dict)
    touch_pack: dict[bytes, str] = field(default_factory=dict)  # the newest touch's pack

    def live_packs(self, now: float) -> set[str]:
        """Packs holding an unexpired key's data or its newest touch."""
        out = set()
        for key, (name, *_) in self.location.items():
            if self.expires_at[key] > now:
                out.add(name)
                if key in self.touch_pack:
                    out.add(self.touch_pack[key])
        return out


def scan(folder: str | Path, namespace: bytes | None) -> PackScan:
    """Read every pack's trailer in ``folder`` (no payload is read; nothing is changed). A key in
    several packs is located where its data entry has the latest expiry."""
    out = PackScan()
    newest: dict[bytes, tuple[float, float]] = {}  # the newest touch's (last use, expiry)
    for entry in os.scandir(folder):
        if entry.name.startswith(".tmp."):
            with contextlib.suppress(FileNotFoundError):
                out.temporary.append((entry.path, entry.stat().st_mtime))
            continue
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            entries = read_trailer(fd, size, namespace)
        except PackError as e:
            out.bad.append((entry.path, e.reason, str(e)))
            continue
        finally:
            os.close(fd)
        out.sizes[entry.name] = size
        for e in entries:
            out.last_used[e.key] = max(out.last_used.get(e.key, 0.0), e.last_used)
            out.expires_at[e.key] = max(out.expires_at.get(e.key, 0.0), e.expires_at)
            if e.kind == TOUCH:
                if (e.last_used, e.expires_at) >= newest.get(e.key, (0.0, 0.0)):
                    newest[e.key] = (e.last_used, e.expires_at)
                    out.touch_pack[e.key] = entry.name
            else:
                old = out.location.get(e.key)
                if old is None or e.expires_at > old[3]:
                    out.location[e.key] = (entry.name, e.offset, e.length, e.expires_at)
    return out


@dataclass(slots=True)
class _Pack:
    name: str
    size: int
    data: set[bytes] = field(default_factory=set)  # keys indexed in this pack
    touches: set[bytes] = field(default_factory=set)  # keys whose newest touch is here


@dataclass(slots=True)
class _Block:
    pack: _Pack
    offset: int
    length: int
    meta: Entry  # retention state (size: the record's bytes)
    touch: _Pack | None = None  # the pack holding the newest persisted touch


class PackTier:
    shared = False

    def __init__(
        self,
        name: str,
        root: Path,
        namespace: bytes,
        namespace_info: dict,
        capacity_bytes: int,
        policy: RetentionPolicy,
        counters: TierCounters,
        clock: Callable[[], float],
    ) -> None:
        self.name = name
        self.dir = namespace_dir(root, namespace)
        self.packs_dir = self.dir / "packs"
        self.namespace = namespace
        self.capacity = capacity_bytes
        self.policy = policy
        self.counters = counters
        self.clock = clock
        self.lock = threading.RLock()
        self.held: set[bytes] = set()  # keys under a store hold: their packs are never evicted
        self.index: dict[bytes, _Block] = {}
        self.packs: dict[str, _Pack] = {}
        self.used = 0
        self._touched: dict[bytes, Entry] = {}  # touches not yet written to a pack
        self._logged: set[str] = set()
        make_dirs(self.packs_dir)
        info = self.dir / "NAMESPACE.json"
        if not info.is_file():
            write_atomic(info, json.dumps(namespace_info, indent=1, sort_keys=True).encode())
        self.rescan()

    # ------------------------------------------------------------------ index
    def pack_path(self, name: str) -> str:
        return os.path.join(self.packs_dir, name)

    def rescan(self) -> None:
        """Rebuild the index from the packs' trailers; bad packs, old-format block files and stale
        temporary files are removed (the first two counted)."""
        now = self.clock()
        for sub in self.dir.iterdir():  # the previous disk format: one file per block
            if sub.is_dir() and len(sub.name) == 2:
                for entry in os.scandir(sub):
                    if entry.name.endswith(BLOCK_SUFFIX):
                        self._bad("version", entry.path, "a per-block file of the previous disk format")
                    else:
                        _unlink(entry.path)
                with contextlib.suppress(OSError):
                    os.rmdir(sub)
        found = scan(self.packs_dir, self.namespace)
        for path, reason, detail in found.bad:
            self._bad(reason, path, detail)
        for path, mtime in found.temporary:
            if now - mtime > STALE_TMP_S and mtime <= now:
                _unlink(path)
        with self.lock:
            self.packs = {name: _Pack(name, size) for name, size in found.sizes.items()}
            self.used = sum(found.sizes.values())
            self.index = {}
            for key, (name, offset, length, _) in found.location.items():
                if found.expires_at[key] <= now:  # expired: never served
                    continue
                pack = self.packs[name]
                block = _Block(
                    pack, offset, length, Entry(key, length, found.last_used[key], found.expires_at[key])
                )
                pack.data.add(key)
                touch = found.touch_pack.get(key)
                if touch is not None:
                    block.touch = self.packs[touch]
                    block.touch.touches.add(key)
                self.index[key] = block
            for pack in list(self.packs.values()):  # nothing unexpired in it
                self._maybe_unlink(pack)
            self._gauges()

    def contains(self, key: bytes, now: float) -> bool:
        block = self.index.get(key)
        return block is not None and block.meta.expires_at > now

    # ------------------------------------------------------------------ read
    def read(self, key: bytes, now: float) -> memoryview | None:
        """The verified payload of ``key``, or None (missing, expired or bad: a bad record's pack is
        removed)."""
        block = self.index.get(key)
        if block is None or block.meta.expires_at <= now:
            return None
        path = self.pack_path(block.pack.name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            with self.lock:
                self._unindex(key)
            return None
        try:
            raw = os.pread(fd, block.length, block.offset)
        finally:
            os.close(fd)
        try:
            if len(raw) != block.length:
                raise record.RecordError("truncated", f"{len(raw)} of {block.length} record bytes")
            payload = record.decode(raw, key, self.namespace)
        except record.RecordError as e:
            with self.lock:
                self._drop_pack(block.pack)
                self._bad(e.reason, path, str(e))
                self._gauges()
            return None
        with self.lock:
            self.counters.hits += 1
            self.counters.bytes_read += len(raw)
        return payload

    def touch(self, key: bytes, now: float, cls: str) -> None:
        """A hit or a repeated save: last use = now, expiry extended for ``cls`` (never shortened);
        written with the next batch (``write_batch``) or at ``close``."""
        with self.lock:
            block = self.index.get(key)
            if block is None or block.meta.expires_at <= now:  # an expired entry is never revived
                return
            block.meta.last_used = now
            block.meta.expires_at = self.policy.expiry(block.meta.expires_at, now, cls)
            self._touched[key] = block.meta

    # ------------------------------------------------------------------ write
    def write_batch(self, items: list[tuple[bytes, bytes | memoryview, str]], now: float) -> None:
        """Write (key, payload, class) records as one pack, with the touches made since the last
        one; keys already present are only touched. Durable when this returns."""
        new, seen = [], set()
        for key, payload, cls in items:
            if key in self.index:
                self.touch(key, now, cls)
            elif key not in seen:
                seen.add(key)
                new.append((key, payload, cls))
        with self.lock:
            touched, self._touched = self._touched, {}
        bufs: list[bytes | memoryview] = []
        entries: list[PackEntry] = []
        offset = 0
        for key, payload, cls in new:
            header = record.encode_header(key, self.namespace, payload, now, cls)
            length = len(header) + memoryview(payload).nbytes
            entries.append(PackEntry(key, offset, length, now, self.policy.expiry(None, now, cls), DATA))
            bufs += (header, payload)
            offset += length
        entries += [PackEntry(k, 0, 0, m.last_used, m.expires_at, TOUCH) for k, m in touched.items()]
        if not entries:
            return
        bufs.append(encode_trailer(entries, self.namespace))
        size = offset + len(bufs[-1])
        with self.lock:
            if not self._make_room(size, now):  # full of held packs: the new blocks stay in host memory
                entries = [e for e in entries if e.kind == TOUCH]
                if not entries:
                    return
                bufs = [encode_trailer(entries, self.namespace)]
                size = len(bufs[0])
        name = f"{secrets.token_hex(8)}{SUFFIX}"
        path = self.pack_path(name)
        tmp = self.pack_path(f".tmp.{name}")
        try:
            _write_synced(tmp, bufs)
            try:
                os.rename(tmp, path)  # unique names: nothing is replaced
            except BaseException:
                _unlink(tmp)
                raise
            fsync_dir(self.packs_dir)
        except BaseException:  # the touches go with the next pack
            with self.lock:
                for key, meta in touched.items():
                    if key in self.index:
                        self._touched.setdefault(key, meta)
            raise
        pack = _Pack(name, size)
        with self.lock:
            self.packs[name] = pack
            self.used += size
            for e in entries:
                block = self.index.get(e.key)
                if e.kind == DATA:
                    if block is not None:  # a rescan found it meanwhile: its first location stays
                        continue
                    self.index[e.key] = _Block(
                        pack, e.offset, e.length, Entry(e.key, e.length, now, e.expires_at)
                    )
                    pack.data.add(e.key)
                    self.counters.writes += 1
                    self.counters.bytes_written += e.length
                elif block is not None:
                    old, block.touch = block.touch, pack
                    pack.touches.add(e.key)
                    if old is not None:
                        old.touches.discard(e.key)
                        self._maybe_unlink(old)
            self._maybe_unlink(pack)
            self._gauges()

    def close(self) -> None:
        """Write the touches not yet in a pack."""
        if self._touched:
            self.write_batch([], self.clock())

    # ------------------------------------------------------------------ retention
    def _make_room(self, incoming: int, now: float) -> bool:
        if self.used + incoming <= 0.95 * self.capacity:
            return True
        entries = []
        for pack in self.packs.values():
            if not pack.data:
                continue
            metas = [self.index[k].meta for k in pack.data]
            leased = any(k in self.held for k in pack.data)
            entries.append(
                Entry(
                    pack.name.encode(),
                    pack.size,
                    max(m.last_used for m in metas),
                    max(m.expires_at for m in metas),
                    leased,
                )
            )
        others = self.used - sum(e.size for e in entries)  # packs holding only touches
        victims, fits = plan_eviction(entries, now, self.capacity, incoming + others)
        for name in victims:
            pack = self.packs[name.decode()]
            if max(self.index[k].meta.expires_at for k in pack.data) <= now:
                self.counters.expirations += len(pack.data)
            else:
                self.counters.evictions += len(pack.data)
            self._drop_pack(pack)
        return fits

    def collect(self, now: float) -> int:
        """Remove every expired entry (and the packs left holding nothing); returns how many."""
        with self.lock:
            keys = [k for k, b in self.index.items() if b.meta.expires_at <= now and k not in self.held]
            for key in keys:
                self._unindex(key)
            self.counters.expirations += len(keys)
            self._gauges()
        return len(keys)

    def remove(self, key: bytes) -> None:
        with self.lock:
            self._unindex(key)
            self._gauges()

    def _unindex(self, key: bytes) -> None:
        block = self.index.pop(key, None)
        if block is None:
            return
        self._touched.pop(key, None)
        block.pack.data.discard(key)
        self._maybe_unlink(block.pack)
        if block.touch is not None:
            block.touch.touches.discard(key)
            self._maybe_unlink(block.touch)

    def _drop_pack(self, pack: _Pack) -> None:
        """Unindex every block of ``pack`` and remove it."""
        for key in list(pack.data):
            self._unindex(key)
        pack.touches.clear()
        self._maybe_unlink(pack)

    def _maybe_unlink(self, pack: _Pack) -> None:
        if pack.data or pack.touches or self.packs.get(pack.name) is not pack:
            return
        del self.packs[pack.name]
        self.used -= pack.size
        _unlink(self.pack_path(pack.name))

    def _bad(self, reason: str, path: str, detail: str) -> None:
        self.counters.corrupt_reads += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning(
                "kv store %s: %s is bad (%s); treated as a miss and removed", self.name, path, detail
            )
        _unlink(path)

    def _gauges(self) -> None:
        self.counters.entries = len(self.index)
        self.counters.bytes = self.used


def _write_synced(tmp: str, bufs: list[bytes | memoryview]) -> None:
    """Create ``tmp`` (exclusive) holding ``bufs`` in order and fsync it; on any error it is removed.
    ``writev`` copies the whole batch with the GIL released."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pending, first = list(bufs), 0
        while first < len(pending):
            written = os.writev(fd, pending[first : first + MAX_IOV])
            while first < len(pending) and written >= memoryview(pending[first]).nbytes:
                written -= memoryview(pending[first]).nbytes
                first += 1
            if written:  # a short write inside a buffer: go on from there
                pending[first] = memoryview(pending[first]).cast("B")[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)


def _unlink(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
