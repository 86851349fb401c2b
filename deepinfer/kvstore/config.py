"""``KVStoreConfig``: the KV store's settings (one field block of ``EngineConfig``).

Validated at construction: a path that cannot be written, a capacity of 0, a malformed TTL or a
default class without a TTL raise ``ValueError`` naming the option. Sizes are GiB. The store is on
when this config is given (``EngineConfig.kv_store``); its host tier is always present.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deepinfer.kvstore.retention import DEFAULT_TTLS, parse_ttls


class KVStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host_cache_gib: float = Field(1.0, gt=0, description="host-memory tier size (pinned on devices)")
    path: str | None = Field(
        None,
        description="disk tier: a directory on local SSD, owned by one store at a time (owner.lock); "
        "data-parallel ranks each use PATH/rank-N",
    )
    capacity_gib: float = Field(16.0, gt=0, description="disk tier capacity")
    shared_path: str | None = Field(
        None, description="shared tier: a directory on a shared filesystem mount (3FS, NFS, CephFS, ...)"
    )
    shared_capacity_gib: float = Field(64.0, gt=0, description="shared tier capacity (this process's view)")
    ttls: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_TTLS),
        description="seconds per traffic class; also accepts 'agent=3d,chat=7d'",
    )
    default_class: str = Field("chat", description="traffic class of requests that name none")
    swa_replay: Literal["exact", "bounded"] | None = Field(
        None, description="sliding-window replay mode; None reads DEEPINFER_SWA_REPLAY"
    )
    swa_replay_tokens: int = Field(128, ge=1, description="bounded replay: tokens recomputed")
    write_queue_blocks: int = Field(
        4096,
        ge=1,
        description="write-behind backlog in blocks (each leases a host slot until written); saves "
        "past it stay in host memory only, counted as writes_dropped",
    )

    write_window_ms: float = Field(
        200.0,
        ge=0,
        description="the write-behind gathers saves this long into one batch made durable at once "
        "(fewer syncs and writer wake-ups); local disk tier only: with a shared tier every batch is "
        "written as soon as it is queued",
    )

    @field_validator("ttls", mode="before")
    @classmethod
    def _parse_ttls(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_ttls(value)
        return value

    @field_validator("ttls")
    @classmethod
    def _positive_ttls(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("give at least one traffic class")
        bad = [k for k, v in value.items() if v <= 0]
        if bad:
            raise ValueError(f"TTLs must be positive; not so for {', '.join(bad)}")
        return value

    @field_validator("path", "shared_path")
    @classmethod
    def _writable(cls, value: str | None) -> str | None:
        if value is not None:
            check_writable(Path(value))
        return value

    @field_validator("shared_path")
    @classmethod
    def _not_the_disk_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        path = info.data.get("path")
        if value is not None and path is not None and Path(value).resolve() == Path(path).resolve():
            raise ValueError(
                f"{value} is also the disk tier's path; the disk tier (pack files) and the shared "
                "tier (a file per block) need their own directories"
            )
        return value

    @model_validator(mode="after")
    def _default_has_ttl(self) -> KVStoreConfig:
        if self.default_class not in self.ttls:
            raise ValueError(
                f"default_class {self.default_class!r} has no TTL; classes: {', '.join(self.ttls)}"
            )
        return self


def check_writable(path: Path) -> None:
    """Create ``path`` if needed and prove a file can be created, synced and removed in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{path} is not a writable directory ({e.strerror or e})") from None
