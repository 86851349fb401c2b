"""Platform registry: maps ``DEEPINFER_ACCELERATOR`` values to Platform classes.

Built-in platforms are listed here as qualname strings; out-of-tree platforms come from the entry-point
group ``deepinfer.platforms``, whose entry points name a zero-argument ``register()`` function that
returns the ``"module:Class"`` qualname of a Platform subclass (or ``None`` to opt out on this host).
No platform module is imported until that platform is probed.

``current_platform()`` resolves once per process (lazily, on first use) and is what the engine uses.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from deepinfer import envs
from deepinfer.logger import get_logger
from deepinfer.platform.interface import Platform, PlatformUnavailableError

ENTRY_POINT_GROUP = "deepinfer.platforms"

BUILTIN_PLATFORMS: dict[str, str] = {
    "cpu": "deepinfer.platform.cpu:CpuPlatform",
    "nvidia": "deepinfer.platform.nvidia:NvidiaPlatform",
    "ascend": "deepinfer.platform.ascend:AscendPlatform",
}
AUTO_ORDER = ("ascend", "nvidia", "cpu")

logger = get_logger(__name__)
_current: Platform | None = None


def registered_platforms() -> dict[str, str]:
    """Name -> ``"module:Class"`` for the built-ins and every installed out-of-tree platform."""
    table = dict(BUILTIN_PLATFORMS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        qualname = ep.load()()
        if qualname is None:
            continue
        if not isinstance(qualname, str) or ":" not in qualname:
            raise TypeError(
                f"platform entry point {ep.name!r} ({ep.value}) must return a 'module:Class' string or "
                f"None, got {qualname!r}"
            )
        if ep.name in table:
            raise ValueError(
                f"platform name {ep.name!r} from entry point {ep.value} is already registered by "
                f"{table[ep.name]}"
            )
        table[ep.name] = qualname
    return table


def load_platform_class(qualname: str) -> type[Platform]:
    module_name, _, attr = qualname.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"{qualname} is not a deepinfer Platform subclass")
    return cls


def resolve_platform(name: str | None = None) -> Platform:
    """Create the Platform for ``name`` (default: ``DEEPINFER_ACCELERATOR``).

    ``auto`` picks the first available of ascend, nvidia, cpu and logs why. An explicit name the host
    cannot satisfy raises PlatformUnavailableError naming what is missing; an unknown name raises
    ValueError listing the registered names.
    """
    requested = (name or envs.get("DEEPINFER_ACCELERATOR") or "auto").strip().lower()
    table = registered_platforms()
    if requested == "auto":
        skipped = []
        for candidate in AUTO_ORDER:
            cls = load_platform_class(table[candidate])
            detection = cls.detect()
            if detection.available:
                why = "; ".join(f"{n}: {r}" for n, r in skipped) or "first in order"
                logger.info("accelerator auto -> %s (%s). Skipped: %s", candidate, detection.reason, why)
                return cls(detection)
            skipped.append((candidate, detection.reason))
        raise PlatformUnavailableError("auto found no usable platform: " + "; ".join(r for _, r in skipped))
    if requested not in table:
        choices = ", ".join(["auto", *sorted(table)])
        raise ValueError(f"unknown accelerator {requested!r}; choose one of: {choices}")
    cls = load_platform_class(table[requested])
    detection = cls.detect()
    if not detection.available:
        raise PlatformUnavailableError(f"accelerator {requested!r} cannot run here: {detection.reason}")
    logger.info("accelerator %s: %s", requested, detection.reason)
    return cls(detection)


def current_platform() -> Platform:
    """The process-wide platform, resolved from ``DEEPINFER_ACCELERATOR`` on first use."""
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


def set_current_platform(platform: Platform | None) -> None:
    """Replace (or with None, forget) the process-wide platform; for launchers and tests."""
    global _current
    _current = platform
