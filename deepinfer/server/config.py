"""How the HTTP server runs: address, access control and admission limits (the engine's own
settings live in ``EngineConfig``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.router.roles import Role


class ServerConfig(BaseModel):
    """Validated server settings; invalid values raise ``ValueError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str = Field(min_length=1, description="the model name clients must send")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0: any free port")
    api_key: str | None = Field(None, min_length=1, description="required from clients when set")
    max_queued_requests: int = Field(
        256, ge=0, description="requests that may wait for a free engine slot; beyond them: 429"
    )
    max_request_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies: 413")
    retry_after_s: int = Field(1, ge=1, description="the Retry-After sent with 429")
    log_level: str = "info"
    role: Role = Field(Role.BOTH, description="prefill | decode | both: what routers send this worker")
