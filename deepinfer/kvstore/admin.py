"""Offline inspection and upkeep of a store directory: ``deepinfer kvstore stats|verify|gc PATH``.

Works on any disk tier (``PATH/kv1/<namespace>/packs/*.kvp``, ``pack_tier``) or shared tier
(``PATH/kv1/<namespace>/<xx>/<key>.kvb``, ``file_tier``) directory without an engine, while engines
use it: it only reads, and removes files that are expired, bad or stale temporaries (removing is
safe under readers: a reader that loses the race sees a miss; a pack goes whole, once none of its
blocks is live). Results are plain dicts, one per namespace folder (``folder``: its path under
``PATH``; a data-parallel store has one per rank, ``rank-N/kv1/<namespace>``, each rank's own disk
tier; ``gc --capacity-gib`` applies to each), printed as JSON by the CLI.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from deepinfer.kvstore import pack_tier, record
from deepinfer.kvstore.file_tier import STALE_TMP_S, SUFFIX
from deepinfer.kvstore.retention import Entry, plan_eviction


def namespaces(root: Path) -> list[Path]:
    """The namespace folders of the store at ``root``: ``kv1/*``, and ``rank-N/kv1/*`` of the
    data-parallel ranks' disk tiers (each rank owns a subfolder)."""
    root = Path(root)
    ranks = sorted((p for p in root.glob("rank-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    bases = [root / "kv1", *(p / "kv1" for p in ranks)]
    bases = [b for b in bases if b.is_dir()]
    if not bases:
        raise ValueError(
            f"{root} holds no deepinfer KV store (no kv1/ folder, nor data-parallel ranks' rank-N/kv1/)"
        )
    return [p for base in bases for p in sorted(base.iterdir()) if p.is_dir()]


def _files(ns_dir: Path) -> Iterator[os.DirEntry]:
    for sub in ns_dir.iterdir():
        if sub.is_dir() and sub.name not in ("stats", "packs"):
            yield from os.scandir(sub)


def _check(entry: os.DirEntry, ns_dir: Path) -> str | None:
    """None for a good record, else the reason it is bad."""
    try:
        raw = Path(entry.path).read_bytes()
        key = bytes.fromhex(entry.name[: -len(SUFFIX)])
        _, namespace, *_ = record.decode_header(raw)
        if not namespace.hex().startswith(ns_dir.name):
            raise record.RecordError("namespace", "header namespace differs from its folder")
        record.decode(raw, key, namespace)
    except record.RecordError as e:
        return e.reason
    except ValueError:
        return "name"
    return None


def stats(root: Path, verify: bool = False, now: float | None = None) -> list[dict]:
    """Per namespace: entries, bytes, entries and bytes by traffic class (the first writer's),
    expired entries, temporary files, and (``verify``) bad records by reason; plus the hit counts the
    engines that used it last recorded (``stats/``)."""
    now = time.time() if now is None else now
    out = []
    for ns_dir in namespaces(root):
        info = {
            "namespace": ns_dir.name,
            "folder": str(ns_dir.relative_to(root)),
            "entries": 0,
            "bytes": 0,
            "expired": 0,
            "temporary": 0,
        }
        by_class: dict[str, dict[str, int]] = {}
        bad: dict[str, int] = {}
        for entry in _files(ns_dir):
            st = entry.stat()
            if entry.name.startswith(".tmp."):
                info["temporary"] += 1
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            info["entries"] += 1
            info["bytes"] += st.st_size
            info["expired"] += st.st_mtime <= now
            with open(entry.path, "rb") as f:
                head = f.read(record.HEADER_SIZE)
            try:
                cls = record.decode_header(head)[4]
            except record.RecordError:
                cls = "(unreadable)"
            c = by_class.setdefault(cls, {"entries": 0, "bytes": 0})
            c["entries"] += 1
            c["bytes"] += st.st_size
            if verify:
                reason = _check(entry, ns_dir)
                if reason is not None:
                    bad[reason] = bad.get(reason, 0) + 1
        _pack_stats(ns_dir, info, by_class, bad if verify else None, now)
        info["by_class"] = by_class
        if verify:
            info["bad"] = bad
        meta = ns_dir / "NAMESPACE.json"
        info["describes"] = json.loads(meta.read_text()) if meta.is_file() else None
        info["hits_by_class"] = _recorded_hits(ns_dir)
        out.append(info)
    return out


def _packs(ns_dir: Path) -> pack_tier.PackScan | None:
    folder = ns_dir / "packs"
    return pack_tier.scan(folder, None) if folder.is_dir() else None


def _record_of(ns_dir: Path, found: pack_tier.PackScan, key: bytes) -> bytes:
    name, offset, length, _ = found.location[key]
    fd = os.open(ns_dir / "packs" / name, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _pack_check(ns_dir: Path, found: pack_tier.PackScan, key: bytes, full: bool) -> tuple[str, str | None]:
    """(the record's traffic class, None for a good record else the reason it is bad); ``full``
    verifies the payload too, else only the header."""
    try:
        raw = _record_of(ns_dir, found, key)
        if full:
            _, namespace, *_ = record.decode_header(raw)
            if not namespace.hex().startswith(ns_dir.name):
                raise record.RecordError("namespace", "header namespace differs from its folder")
            record.decode(raw, key, namespace)
        return record.decode_header(raw)[4], None
    except record.RecordError as e:
        return "(unreadable)", e.reason


def _pack_stats(ns_dir: Path, info: dict, by_class: dict, bad: dict | None, now: float) -> None:
    """Add the disk tier's packs to ``stats``' counts (``bad``: verify every record into it)."""
    found = _packs(ns_dir)
    if found is None:
        return
    info["bytes"] += sum(found.sizes.values())
    info["temporary"] += len(found.temporary)
    info["packs"] = len(found.sizes)
    for _, reason, _ in found.bad:
        if bad is not None:
            bad[reason] = bad.get(reason, 0) + 1
    for key, (_, _, length, _) in found.location.items():
        info["entries"] += 1
        info["expired"] += found.expires_at[key] <= now
        cls, reason = _pack_check(ns_dir, found, key, full=bad is not None)
        c = by_class.setdefault(cls, {"entries": 0, "bytes": 0})
        c["entries"] += 1
        c["bytes"] += length
        if reason is not None and bad is not None:
            bad[reason] = bad.get(reason, 0) + 1


def _pack_gc(ns_dir: Path, done: dict, capacity_bytes: int | None, now: float) -> None:
    """``gc`` of the disk tier's packs: bad packs (a bad trailer or record) go; a pack goes once it
    holds no unexpired block nor a live block's newest touch; with ``capacity_bytes``, then whole
    packs, least recently used first."""
    found = _packs(ns_dir)
    if found is None:
        return
    for path, _, _ in found.bad:
        os.unlink(path)
        done["bad"] += 1
    for path, mtime in found.temporary:
        if now - mtime > STALE_TMP_S:
            os.unlink(path)
            done["temporary"] += 1
    broken = {found.location[k][0] for k in found.location if _pack_check(ns_dir, found, k, True)[1]}
    done["bad"] += len(broken)
    done["expired"] += sum(1 for k, loc in found.location.items() if found.expires_at[k] <= now)
    live = found.live_packs(now) - broken
    keys_in: dict[str, list[bytes]] = {}
    for key, (name, *_) in found.location.items():
        if found.expires_at[key] > now:
            keys_in.setdefault(name, []).append(key)
    if capacity_bytes is not None:
        entries = [
            Entry(
                name.encode(),
                found.sizes[name],
                max(found.last_used[k] for k in keys_in[name]),
                max(found.expires_at[k] for k in keys_in[name]),
            )
            for name in live
            if name in keys_in
        ]
        others = sum(found.sizes[n] for n in live) - sum(e.size for e in entries)  # touches only
        victims, _ = plan_eviction(entries, now, capacity_bytes, others, high=1.0, low=1.0)
        for name in victims:
            done["evicted"] += len(keys_in[name.decode()])
        live -= {v.decode() for v in victims}
    for name in set(found.sizes) - live:
        os.unlink(ns_dir / "packs" / name)


def _recorded_hits(ns_dir: Path) -> dict[str, int]:
    hits: dict[str, int] = {}
    stats_dir = ns_dir / "stats"
    if stats_dir.is_dir():
        for path in stats_dir.glob("*.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for cls, n in data.get("hits_by_class", {}).items():
                hits[cls] = hits.get(cls, 0) + int(n)
    return hits


def gc(root: Path, capacity_bytes: int | None = None, now: float | None = None) -> list[dict]:
    """Remove expired records, bad records and stale temporary files; with ``capacity_bytes``, then
    evict least recently used records until each namespace fits. Returns what was removed."""
    now = time.time() if now is None else now
    out = []
    for ns_dir in namespaces(root):
        done = {
            "namespace": ns_dir.name,
            "folder": str(ns_dir.relative_to(root)),
            "expired": 0,
            "bad": 0,
            "temporary": 0,
            "evicted": 0,
        }
        live: list[tuple[Entry, str]] = []
        for entry in _files(ns_dir):
            st = entry.stat()
            if entry.name.startswith(".tmp."):
                if now - st.st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)
                    done["temporary"] += 1
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            if st.st_mtime <= now:
                os.unlink(entry.path)
                done["expired"] += 1
            elif _check(entry, ns_dir) is not None:
                os.unlink(entry.path)
                done["bad"] += 1
            else:
                live.append((Entry(entry.name.encode(), st.st_size, st.st_atime, st.st_mtime), entry.path))
        _pack_gc(ns_dir, done, capacity_bytes, now)
        if capacity_bytes is not None:
            paths = {e.key: p for e, p in live}
            victims, _ = plan_eviction([e for e, _ in live], now, capacity_bytes, high=1.0, low=1.0)
            for key in victims:
                os.unlink(paths[key])
            done["evicted"] += len(victims)
        out.append(done)
    return out
