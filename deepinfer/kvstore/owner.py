"""One owner per local disk tier directory: an exclusive ``flock`` on ``PATH/owner.lock``.

The disk tier (``pack_tier``) assumes one process owns its directory: its index is built at start
and its eviction removes whole packs, so two processes on one directory would evict and delete each
other's packs. ``OwnerLock`` makes that assumption hold: the store takes it when it opens its disk
tier and keeps it for its life; ``release`` (at ``KVStore.close``) ends it, and the kernel ends it
when the process dies, however it dies (``kill -9`` included), so a crashed owner never leaves the
directory locked. The lock file records the owner's PID and host, which a second owner's error names.
The shared tier needs no lock: it is written by many processes by design (one write-once file per
block, linked under its name by the first writer).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = "owner.lock"


class StoreDirectoryInUse(RuntimeError):
    """Another process (or another store in this one) owns the disk tier directory."""


class OwnerLock:
    """An exclusive lock on the disk tier directory ``folder`` (created if needed), taken at once
    or refused with ``StoreDirectoryInUse`` naming the directory and the owner's PID and host."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read_owner(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreDirectoryInUse(
                    f"kv store: the disk tier directory {self.folder} is in use by {owner} "
                    f"(it holds {self.path}); give each server its own --kv-store-path"
                ) from None
            raise StoreDirectoryInUse(
                f"kv store: cannot lock the disk tier directory {self.folder} ({e.strerror or e}); "
                "it needs a local filesystem that supports flock"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """End the lock (closing the file unlocks it); the file stays, a later owner rewrites it."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _read_owner(fd: int) -> str:
    """'PID n on host h' from the lock file, or what is known when it is not written yet."""
    text = os.pread(fd, 256, 0).decode(errors="replace").split()
    if len(text) == 4 and text[0] == "pid" and text[2] == "host":
        return f"PID {text[1]} on host {text[3]}"
    return "another process (its PID is not recorded yet)"
