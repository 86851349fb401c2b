"""Command line of the KV store: the ``deepinfer serve`` options and ``deepinfer kvstore``.

``add_serve_args`` adds ``--kv-host-cache-gib``, ``--kv-store-path``, ``--kv-store-capacity-gib``,
``--kv-shared-path``, ``--kv-shared-capacity-gib``, ``--kv-ttl``, ``--kv-default-class``,
``--swa-replay`` and ``--swa-replay-tokens``; ``config_from_args`` turns them into a
``KVStoreConfig`` (None when no store option is given), exiting with one line naming the option when a
value is bad. ``add_kvstore_args`` / ``run_kvstore`` are ``deepinfer kvstore stats|verify|gc PATH``.
"""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from deepinfer.kvstore.config import KVStoreConfig

OPTIONS = {  # KVStoreConfig field -> command-line option
    "host_cache_gib": "--kv-host-cache-gib",
    "path": "--kv-store-path",
    "capacity_gib": "--kv-store-capacity-gib",
    "shared_path": "--kv-shared-path",
    "shared_capacity_gib": "--kv-shared-capacity-gib",
    "ttls": "--kv-ttl",
    "default_class": "--kv-default-class",
    "swa_replay": "--swa-replay",
    "swa_replay_tokens": "--swa-replay-tokens",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV store (off unless one of these is given)")
    g.add_argument("--kv-host-cache-gib", type=float, help="host-memory tier size (default 1)")
    g.add_argument(
        "--kv-store-path",
        help="disk tier directory (local SSD), owned by one server (a lock file in it); "
        "data-parallel ranks use PATH/rank-N",
    )
    g.add_argument("--kv-store-capacity-gib", type=float, help="disk tier capacity (default 16)")
    g.add_argument("--kv-shared-path", help="shared tier directory (a 3FS/NFS/CephFS/JuiceFS mount)")
    g.add_argument("--kv-shared-capacity-gib", type=float, help="shared tier capacity (default 64)")
    g.add_argument("--kv-ttl", help="TTL per traffic class, e.g. agent=3d,chat=7d (the default)")
    g.add_argument("--kv-default-class", help="class of requests that name none (default chat)")
    g.add_argument("--swa-replay", choices=["exact", "bounded"], help="default: DEEPINFER_SWA_REPLAY")
    g.add_argument("--swa-replay-tokens", type=int, help="bounded replay length (default 128)")


def config_from_args(args: argparse.Namespace) -> KVStoreConfig | None:
    given = {
        field: getattr(args, option.removeprefix("--").replace("-", "_")) for field, option in OPTIONS.items()
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    try:
        return KVStoreConfig(**given)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "default_class"
        message = err["msg"].removeprefix("Value error, ")
        raise SystemExit(f"error: {OPTIONS.get(field, field)}: {message}") from None


def add_kvstore_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kvstore_command", required=True)
    for name, text in (
        ("stats", "entries, sizes and hits by traffic class, expired entries"),
        ("verify", "stats, and read every record checking its checksum (reports bad files)"),
        ("gc", "remove expired and bad records and stale temporary files"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("path", help="a --kv-store-path or --kv-shared-path directory")
        if name == "gc":
            p.add_argument("--capacity-gib", type=float, help="then evict LRU records to fit this size")


def run_kvstore(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deepinfer.kvstore import admin

    try:
        if args.kvstore_command == "gc":
            if args.capacity_gib is not None and args.capacity_gib <= 0:
                raise ValueError("--capacity-gib must be positive")
            cap = None if args.capacity_gib is None else int(args.capacity_gib * (1 << 30))
            result = admin.gc(Path(args.path), cap)
        else:
            result = admin.stats(Path(args.path), verify=args.kvstore_command == "verify")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(result, indent=1))
    return 1 if any(r.get("bad") for r in result) else 0
