"""Leases on blocks of a shared KV store directory: the store-side lease table of the P/D handoff.

A prefill worker that hands a prompt's KV blocks to a decode worker takes a lease on their keys
here; while it is unexpired, no process sharing the directory evicts those blocks for room
(``FileTier`` consults :meth:`LeaseTable.held_keys`). The decode worker releases it once it has
loaded the blocks (its ack); the prefill worker, or the router through it (``POST /kv/release``),
releases it when the handoff ended otherwise; an unreleased lease stops holding anything at its
expiry and is removed by the next :meth:`LeaseTable.expire` (a prefill worker sweeps its own).

Layout: ``ROOT/leases/<handoff id>.lease``, one JSON file per lease
(``{"handoff_id", "keys": [hex], "expires_unix", "owner"}``), written to a unique temporary name,
fsynced, renamed, and the folder fsynced, so a reader sees no lease or a whole one. Release is an
``unlink``: idempotent, and safe from any process. ``ROOT/STORE_ID`` names the store (random, made
once, first writer wins): two workers hand blocks to each other only when they report the same id.
Times are unix seconds (leases cross processes and hosts).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".lease"
HANDOFF_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True, slots=True)
class Lease:
    handoff_id: str
    keys: tuple[str, ...]  # hex store keys
    expires_unix: float
    owner: str  # who took it (a worker URL), for its own sweeps


def check_handoff_id(handoff_id: str) -> str:
    """``handoff_id`` if it is 1-128 letters, digits, ``_`` or ``-`` (it names a file); else ``ValueError``."""
    if not isinstance(handoff_id, str) or not HANDOFF_ID.fullmatch(handoff_id):
        raise ValueError(f"handoff_id {handoff_id!r}: expected 1-128 letters, digits, '_' or '-'")
    return handoff_id


class LeaseTable:
    """The lease table of the shared store at ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.dir = self.root / "leases"
        self.dir.mkdir(parents=True, exist_ok=True)

    def store_id(self) -> str:
        """This store's id (created on first use)."""
        path = self.root / "STORE_ID"
        with contextlib.suppress(FileNotFoundError):
            return path.read_text().strip()
        _write_atomic(path, secrets.token_hex(16).encode(), replace=False)
        return path.read_text().strip()

    def _path(self, handoff_id: str) -> Path:
        return self.dir / f"{check_handoff_id(handoff_id)}{SUFFIX}"

    def take(self, handoff_id: str, keys: list[str], expires_unix: float, owner: str) -> Lease:
        """Hold ``keys`` until ``expires_unix`` (durable when this returns); replaces a lease of the
        same id."""
        lease = Lease(handoff_id, tuple(keys), expires_unix, owner)
        data = {"handoff_id": handoff_id, "keys": list(keys), "expires_unix": expires_unix, "owner": owner}
        _write_atomic(self._path(handoff_id), json.dumps(data).encode(), replace=True)
        return lease

    def release(self, handoff_id: str) -> bool:
        """Drop the lease; True when it was there (False: released or expired before; not an error)."""
        try:
            os.unlink(self._path(handoff_id))
            return True
        except FileNotFoundError:
            return False

    def get(self, handoff_id: str) -> Lease | None:
        return _read(self._path(handoff_id))

    def leases(self, owner: str | None = None) -> list[Lease]:
        """Every lease on file (of ``owner`` when given), expired ones included until swept."""
        out = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                lease = _read(Path(entry.path))
                if lease is not None and (owner is None or lease.owner == owner):
                    out.append(lease)
        return out

    def expire(self, now: float | None = None, owner: str | None = None) -> list[str]:
        """Remove the leases (of ``owner`` when given) expired at ``now``; returns their handoff ids
        (only those this call removed)."""
        now = time.time() if now is None else now
        return [
            lease.handoff_id
            for lease in self.leases(owner)
            if lease.expires_unix <= now and self.release(lease.handoff_id)
        ]

    def held_keys(self, now: float | None = None) -> set[bytes]:
        """The keys under an unexpired lease (what eviction must skip)."""
        now = time.time() if now is None else now
        return {bytes.fromhex(k) for lease in self.leases() if lease.expires_unix > now for k in lease.keys}


def _read(path: Path) -> Lease | None:
    try:
        data = json.loads(path.read_bytes())
        keys = tuple(data["keys"])
        for key in keys:
            bytes.fromhex(key)  # a key that is not hex text makes the file foreign
        expires = float(data["expires_unix"])
        if not math.isfinite(expires):
            return None
        return Lease(data["handoff_id"], keys, expires, data["owner"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):  # written whole, so only a foreign file: it holds nothing
        return None


def _write_atomic(path: Path, data: bytes, replace: bool) -> None:
    tmp = path.parent / f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries are durable); filesystems that refuse it are let be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
