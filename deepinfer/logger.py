"""The package logger: one ``deepinfer`` logger, configured once from ``DEEPINFER_LOG_LEVEL``."""

from __future__ import annotations

import logging

from deepinfer import envs

_configured = False


def get_logger(name: str) -> logging.Logger:
    """Return a child of the ``deepinfer`` logger; the first call attaches a stderr handler."""
    global _configured
    root = logging.getLogger("deepinfer")
    if not _configured:
        _configured = True
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            root.addHandler(handler)
        root.setLevel(str(envs.get("DEEPINFER_LOG_LEVEL")).upper())
    return root.getChild(name.removeprefix("deepinfer."))
