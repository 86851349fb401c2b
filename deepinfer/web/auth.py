"""Credentials of the HTTP processes: client API keys and the cluster secret.

Two kinds of caller reach a worker (``deepinfer serve``): clients, who send the worker's API key, and
the router, which never forwards a client's key but proves itself with the **cluster secret**, a
string shared by the router and its workers (``--cluster-secret-file PATH`` or
``DEEPINFER_CLUSTER_SECRET``; ``deepinfer cluster`` makes one per run and hands it to its processes
through the environment, never the command line). The router sends it in :data:`CLUSTER_KEY_HEADER`
on every request to a worker; a worker accepts that header on any route in place of its API key, and
only that header authorises what only a router may ask: handoff orders (``kv_transfer``), lease
releases, load reports, and registration with a router. Keys are compared in constant time.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path

from deepinfer import envs

CLUSTER_KEY_HEADER = "x-deepinfer-cluster-key"
CLUSTER_SECRET_ENV = "DEEPINFER_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


def offered_keys(headers: Mapping[str, str]) -> list[str]:
    """The API keys a request offers (``Authorization: Bearer KEY``, ``x-api-key: KEY``), in that
    order; ``headers`` has lower-case names."""
    offered = []
    bearer = headers.get("authorization", "")
    if bearer[:7].lower() == "bearer ":
        offered.append(bearer[7:].strip())
    offered.append(headers.get("x-api-key", ""))
    return [key for key in offered if key]


def key_matches(offered: str | None, expected: str | None) -> bool:
    """Whether ``offered`` equals ``expected`` (constant time); never true for a missing key."""
    return bool(offered) and bool(expected) and secrets.compare_digest(offered.encode(), expected.encode())


def has_cluster_key(headers: Mapping[str, str], secret: str | None) -> bool:
    """Whether a request (lower-case ``headers``) carries the cluster secret ``secret``."""
    return key_matches(headers.get(CLUSTER_KEY_HEADER), secret)


def check_secret(secret: str, source: str) -> str:
    """``secret`` stripped, or ``ValueError`` naming ``source`` if it is shorter than 16 characters."""
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{source}: the cluster secret must be at least {MIN_SECRET_CHARS} characters "
            f"(got {len(secret)}); make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return secret


def load_cluster_secret(path: str | Path | None) -> str | None:
    """The cluster secret from the file ``path`` (its whole content, stripped), else from
    ``DEEPINFER_CLUSTER_SECRET``, else ``None``. A missing, unreadable or too short secret is a
    ``ValueError`` naming where it came from."""
    if path is not None:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--cluster-secret-file {path}: cannot read it ({exc})") from None
        return check_secret(text, f"--cluster-secret-file {path}")
    value = envs.get(CLUSTER_SECRET_ENV)
    if value is None:
        return None
    return check_secret(value, CLUSTER_SECRET_ENV)


def new_cluster_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)
