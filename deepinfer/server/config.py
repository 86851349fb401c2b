"""How the HTTP server runs: address, access control, admission and output limits, timeouts, and
what happens when the engine core dies (the engine's own settings live in ``EngineConfig``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.core.roles import Role

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServerConfig(BaseModel):
    """Validated server settings; invalid values raise ``ValueError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str = Field(min_length=1, description="the model name clients must send")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0: any free port")
    api_key: str | None = Field(None, min_length=1, description="required from clients when set")
    cluster_secret: str | None = Field(
        None,
        min_length=16,
        description="the secret shared with routers (deepinfer.web.auth); handoff orders need it",
    )
    max_queued_requests: int = Field(
        256, ge=0, description="requests that may wait for a free engine slot; beyond them: 429"
    )
    max_request_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies: 413")
    retry_after_s: int = Field(1, ge=1, description="the Retry-After sent with 429 and 503")
    max_tokens_default: int | None = Field(
        1024, ge=1, description="new tokens of a request that sets no limit (None: up to the context length)"
    )
    max_tokens_limit: int | None = Field(
        None, ge=1, description="most new tokens a request may ask for (None: the context length)"
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="end a request that runs longer (error to the client, KV blocks freed)"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM/SIGINT: how long in-flight requests may finish before they are cut",
    )
    restart_engine: bool = Field(False, description="restart a dead engine core instead of exiting non-zero")
    front_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="nice increment of the API front's threads (0: off; Linux; see priority.py)",
    )
    timeout_keep_alive_s: float = Field(5.0, gt=0, description="close connections idle this long")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this time: 408")
    log_level: str = "info"
    role: Role | None = Field(
        None, description="what routers send this worker; None: the platform's node role"
    )
    model_fingerprint: str = Field(
        "", description="of the model folder's config and tokenizer (routers check it)"
    )

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")
