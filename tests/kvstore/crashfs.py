"""A recording file-system shim for crash-point tests of the KV store's file tiers (tests only).

``Recorder`` replaces the ``os`` module the tiers use (``pack_tier.os``, ``file_tier.os``) with a
proxy that performs every call for real and logs the mutating ones: ``open`` (creations),
``write``/``writev``/``pwrite``, ``utime``, ``fsync``/``fdatasync`` (of files and of directories),
``rename``/``replace``, ``link``, ``unlink``/``remove``, ``mkdir``/``makedirs`` and ``close``. A
mutating call it does not model fails the test (``UnmodelledCall``) rather than being missed. The
test adds ``commit`` markers when a write call returns (the tier reported the batch durable).

``crash_state(base, log[:k], mode, dest)`` replays a prefix of the log on a model of inodes and
directories and writes out what a crash at that point may leave:

- ``lost``: only file contents that were fsynced and only directory entries whose directory was
  fsynced survive (each directory as of its last fsync);
- ``ordered``: every directory operation survives (a journal that keeps metadata in order) but file
  contents only as of their last fsync (delayed allocation: a renamed file can come back empty);
- ``torn``: every directory operation survives and each file keeps its fsynced contents plus the
  first half of what was written after (a partial write).

The base is the real directory when recording starts, taken as durable.
"""

from __future__ import annotations

import os
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("lost", "ordered", "torn")
_UNMODELLED = {
    "ftruncate",
    "truncate",
    "rmdir",
    "removedirs",
    "renames",
    "symlink",
    "posix_fallocate",
    "copy_file_range",
    "sendfile",
    "chmod",
    "fchmod",
}


class UnmodelledCall(AssertionError):
    """A tier called a mutating ``os`` function the crash model does not know."""


@dataclass(slots=True)
class Inode:
    data: bytearray
    durable: bytes
    times: tuple[float, float]
    durable_times: tuple[float, float]


@dataclass(slots=True)
class Folder:
    live: dict[str, tuple[str, object]] = field(
        default_factory=dict
    )  # name -> ("file", Inode) | ("dir", path)
    durable: dict[str, tuple[str, object]] = field(default_factory=dict)


def snapshot(root: Path) -> dict[str, object]:
    """The real tree under ``root``: {relative path: bytes and (atime, mtime)} for files, None for folders."""
    out: dict[str, object] = {".": None}
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        for d in dirs:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in files:
            path = os.path.join(folder, f)
            st = os.stat(path)
            out[os.path.normpath(os.path.join(rel, f))] = (
                Path(path).read_bytes(),
                (st.st_atime, st.st_mtime),
            )
    return out


class Recorder:
    """Install with ``install(monkeypatch, *modules)``: each module's ``os`` becomes the proxy."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.abspath(root)
        self.base = snapshot(Path(root))
        self.log: list[tuple] = []
        self.proxy = self._proxy()

    def install(self, monkeypatch, *modules: types.ModuleType) -> None:
        for module in modules:
            monkeypatch.setattr(module, "os", self.proxy)

    def commit(self, keys: list[bytes]) -> None:
        """Mark that the tier reported ``keys`` durable at this point."""
        self.log.append(("commit", tuple(keys)))

    def forget(self, keys: list[bytes]) -> None:
        """Mark that ``keys`` were removed: from here on they need not survive a crash."""
        self.log.append(("forget", tuple(keys)))

    def _rel(self, path) -> str:
        path = os.path.abspath(os.fspath(path))
        if os.path.commonpath([path, self.root]) != self.root:
            raise UnmodelledCall(f"{path} lies outside the recorded folder {self.root}")
        return os.path.normpath(os.path.relpath(path, self.root))

    def _proxy(self) -> types.SimpleNamespace:
        log, rel = self.log, self._rel

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            fd = os.open(path, flags, mode)
            log.append(("open", rel(path), flags, fd, time.time()))
            return fd

        def write(fd, data):
            n = os.write(fd, data)
            log.append(("write", fd, bytes(memoryview(data).cast("B")[:n]), None))
            return n

        def writev(fd, buffers):
            buffers = list(buffers)
            n = os.writev(fd, buffers)
            joined = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            log.append(("write", fd, joined[:n], None))
            return n

        def pwrite(fd, data, offset):
            n = os.pwrite(fd, data, offset)
            log.append(("write", fd, bytes(memoryview(data).cast("B")[:n]), offset))
            return n

        def utime(target, times=None, **kwargs):
            os.utime(target, times, **kwargs)
            when = times if times is not None else (time.time(), time.time())
            log.append(("utime", target if isinstance(target, int) else rel(target), tuple(when)))

        def fsync(fd):
            os.fsync(fd)
            log.append(("fsync", fd))

        def close(fd):
            os.close(fd)
            log.append(("close", fd))

        def rename(src, dst):
            os.rename(src, dst)
            log.append(("rename", rel(src), rel(dst)))

        def replace(src, dst):
            os.replace(src, dst)
            log.append(("rename", rel(src), rel(dst)))

        def link(src, dst):
            os.link(src, dst)
            log.append(("link", rel(src), rel(dst)))

        def unlink(path):
            os.unlink(path)
            log.append(("unlink", rel(path)))

        def mkdir(path, mode=0o777):
            os.mkdir(path, mode)
            log.append(("mkdir", rel(path)))

        def makedirs(path, mode=0o777, exist_ok=False):
            path = os.path.abspath(os.fspath(path))
            if os.path.isdir(path):
                if not exist_ok:
                    raise FileExistsError(path)
                return
            parent = os.path.dirname(path)
            if not os.path.isdir(parent):
                makedirs(parent, mode, exist_ok=True)
            mkdir(path, mode)

        names = {
            "open": open_,
            "write": write,
            "writev": writev,
            "pwrite": pwrite,
            "utime": utime,
            "fsync": fsync,
            "fdatasync": fsync,
            "close": close,
            "rename": rename,
            "replace": replace,
            "link": link,
            "unlink": unlink,
            "remove": unlink,
            "mkdir": mkdir,
            "makedirs": makedirs,
        }

        class Proxy(types.SimpleNamespace):
            def __getattr__(self, name: str):
                if name in _UNMODELLED:
                    raise UnmodelledCall(f"os.{name} is not modelled by crashfs; model it before using it")
                return getattr(os, name)

        return Proxy(**names)


def committed(log: list[tuple]) -> set[bytes]:
    """Keys reported durable in ``log`` and not removed after."""
    out: set[bytes] = set()
    for op in log:
        if op[0] == "commit":
            out.update(op[1])
        elif op[0] == "forget":
            out.difference_update(op[1])
    return out


def crash_state(base: dict[str, object], log: list[tuple], mode: str, dest: Path) -> None:
    """Write into the empty folder ``dest`` what a crash after ``log`` may leave, per ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    folders = {path: Folder() for path, value in base.items() if value is None}
    for path, value in base.items():
        if path == ".":
            continue
        parent, name = os.path.split(path)
        parent = parent or "."
        if value is None:
            entry: tuple[str, object] = ("dir", path)
        else:
            data, times = value
            entry = ("file", Inode(bytearray(data), bytes(data), times, times))
        folders[parent].live[name] = entry
        folders[parent].durable[name] = entry
    fds: dict[int, list] = {}  # fd -> [("file", inode) | ("dir", path), position]

    def lookup(path: str) -> tuple[Folder, str]:
        parent, name = os.path.split(path)
        return folders[parent or "."], name

    for op in log:
        kind = op[0]
        if kind == "open":
            _, path, flags, fd, when = op
            if path in folders:
                fds[fd] = [("dir", path), 0]
                continue
            folder, name = lookup(path)
            entry = folder.live.get(name)
            if entry is None and not flags & os.O_CREAT:
                raise UnmodelledCall(f"{path} was opened but created outside the shim")
            if entry is None:
                entry = ("file", Inode(bytearray(), b"", (when, when), (when, when)))
                folder.live[name] = entry
            elif flags & os.O_TRUNC:
                entry[1].data.clear()
            fds[fd] = [entry, 0]
        elif kind == "write":
            _, fd, data, offset = op
            entry, pos = fds[fd]
            inode = entry[1]
            at = pos if offset is None else offset
            if len(inode.data) < at:
                inode.data.extend(b"\0" * (at - len(inode.data)))
            inode.data[at : at + len(data)] = data
            if offset is None:
                fds[fd][1] = at + len(data)
        elif kind == "utime":
            _, target, times = op
            if isinstance(target, int):
                fds[target][0][1].times = times
            else:
                folder, name = lookup(target)
                folder.live[name][1].times = times
        elif kind == "fsync":
            entry = fds[op[1]][0]
            if entry[0] == "dir":
                folders[entry[1]].durable = dict(folders[entry[1]].live)
            else:
                entry[1].durable = bytes(entry[1].data)
                entry[1].durable_times = entry[1].times
        elif kind == "close":
            del fds[op[1]]
        elif kind in ("rename", "link"):
            _, src, dst = op
            sf, sn = lookup(src)
            df, dn = lookup(dst)
            df.live[dn] = sf.live[sn]
            if kind == "rename":
                del sf.live[sn]
        elif kind == "unlink":
            folder, name = lookup(op[1])
            del folder.live[name]
        elif kind == "mkdir":
            folders[op[1]] = Folder()
            folder, name = lookup(op[1])
            folder.live[name] = ("dir", op[1])
        elif kind not in ("commit", "forget"):
            raise UnmodelledCall(f"unknown log entry {op!r}")
    _write_out(folders, ".", dest, mode)


def _write_out(folders: dict[str, Folder], path: str, dest: Path, mode: str) -> None:
    folder = folders[path]
    dest.mkdir(parents=True, exist_ok=True)
    for name, (kind, value) in (folder.durable if mode == "lost" else folder.live).items():
        target = dest / name
        if kind == "dir":
            _write_out(folders, value, target, mode)
            continue
        inode = value
        data = inode.durable
        if mode == "torn" and len(inode.data) > len(data) and bytes(inode.data[: len(data)]) == data:
            data = bytes(inode.data[: len(data) + (len(inode.data) - len(data)) // 2])
        target.write_bytes(data)
        os.utime(target, inode.durable_times)
