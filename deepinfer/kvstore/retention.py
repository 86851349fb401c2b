"""Retention and eviction policy: pure functions of entries and an injected clock.

No I/O and no clock of its own (every function takes ``now``), so the tiers, ``deepinfer kvstore gc``
and the cluster simulator run the same policy. Rules:

- A request carries a traffic class; each class has a TTL (defaults ``agent`` 3 days, ``chat`` 7
  days, as DeepSeek runs them). An entry expires ``ttl`` seconds after its last save or hit; a save or
  hit by a longer-lived class extends it, a shorter one never shortens it, so a block shared by
  classes keeps the longest TTL.
- An expired entry is never served, and is collected (``expired``).
- A tier over its high watermark evicts down to its low watermark: expired entries first (earliest
  expiry first), then least recently used; leased entries (being loaded or written) are never evicted.
  When leases keep the tier above its low watermark, only what the new data needs is evicted; when
  they keep it from fitting new data at all, the write is refused (fails closed) rather than
  exceeding the cap.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_TTLS = {"agent": 3 * 86400.0, "chat": 7 * 86400.0}
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.85
_CLASS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,15}$")


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"3d"`` (or plain seconds) -> seconds (> 0)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive duration like 90s, 30m, 12h or 3d")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def parse_ttls(text: str) -> dict[str, float]:
    """``"agent=3d,chat=7d"`` -> {class: seconds}. Class names: lowercase, 1-16 of [a-z0-9_-]."""
    out: dict[str, float] = {}
    for part in (p for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not _CLASS_NAME.match(name):
            raise ValueError(
                f"{part.strip()!r} is not CLASS=DURATION (class: lowercase letters, digits, "
                "_ or -, up to 16; duration like 3d)"
            )
        if name in out:
            raise ValueError(f"class {name!r} is given twice")
        out[name] = parse_duration(value)
    if not out:
        raise ValueError("no classes given (expected e.g. agent=3d,chat=7d)")
    return out


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    ttls: dict[str, float]  # class -> seconds
    default_class: str

    def __post_init__(self) -> None:
        if self.default_class not in self.ttls:
            raise ValueError(
                f"default traffic class {self.default_class!r} has no TTL; classes: {', '.join(self.ttls)}"
            )

    def check_class(self, cls: str | None) -> str:
        """The class a request runs under (``None``: the default); unknown names raise ValueError."""
        if cls is None:
            return self.default_class
        if cls not in self.ttls:
            raise ValueError(f"traffic_class {cls!r} is unknown; configured classes: {', '.join(self.ttls)}")
        return cls

    def expiry(self, current: float | None, now: float, cls: str) -> float:
        """An entry's expiry after a save or hit by ``cls`` at ``now``: never earlier than before."""
        new = now + self.ttls[cls]
        return new if current is None else max(current, new)


@dataclass(slots=True)
class Entry:
    """What the policy knows of one stored block."""

    key: bytes
    size: int  # bytes (or slots, for the host tier)
    last_used: float
    expires_at: float
    leased: bool = False


def is_expired(entry: Entry, now: float) -> bool:
    return entry.expires_at <= now


def expired(entries: Iterable[Entry], now: float) -> list[bytes]:
    """Keys of expired, unleased entries, earliest expiry first (to collect)."""
    out = [e for e in entries if not e.leased and is_expired(e, now)]
    out.sort(key=lambda e: e.expires_at)
    return [e.key for e in out]


def plan_eviction(
    entries: Iterable[Entry],
    now: float,
    capacity: int,
    incoming: int = 0,
    high: float = HIGH_WATERMARK,
    low: float = LOW_WATERMARK,
) -> tuple[list[bytes], bool]:
    """Which entries to remove so that ``incoming`` more bytes fit under ``capacity``.

    Nothing is removed while used + incoming stays at or under ``high * capacity``; past it, expired
    entries go first, then least recently used, until used + incoming is at most ``low * capacity``
    (or the unleased entries run out). When the leased entries and ``incoming`` alone exceed
    ``low * capacity``, only what ``incoming`` needs to fit under ``capacity`` is removed (emptying
    the tier of every unleased entry would not reach the low watermark either). Returns (keys to
    remove, whether ``incoming`` then fits under ``capacity``).
    """
    entries = list(entries)
    used = sum(e.size for e in entries)
    if used + incoming <= high * capacity:
        return [], used + incoming <= capacity
    candidates = [e for e in entries if not e.leased]
    candidates.sort(
        key=lambda e: (not is_expired(e, now), e.expires_at if is_expired(e, now) else e.last_used)
    )
    pinned = used - sum(e.size for e in candidates) + incoming
    target = low * capacity if pinned <= low * capacity else capacity
    out = []
    for e in candidates:
        if used + incoming <= target:
            break
        out.append(e.key)
        used -= e.size
    return out, used + incoming <= capacity
