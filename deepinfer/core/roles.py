"""Worker roles. Light on purpose: the server's config and the command line import it."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """What a worker does in a disaggregated deployment. ``both``: whole requests (aggregated)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


def resolve_role(flag: str | None, node_role: str) -> Role:
    """The worker's role: ``--role`` when given, else the platform's node role (950PR -> prefill,
    950DT -> decode, others -> both). An unknown value is a ``ValueError`` naming ``--role``."""
    value = flag if flag is not None else node_role
    try:
        return Role(value)
    except ValueError:
        accepted = ", ".join(r.value for r in Role)
        raise ValueError(f"--role: {value!r} is not a role (accepted: {accepted})") from None
