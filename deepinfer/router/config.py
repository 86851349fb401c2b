"""How the router runs: its workers, policies, timeouts and retries. One validated source of truth for
``deepinfer router`` and ``deepinfer cluster``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typing_extensions import Self

from deepinfer.router.policies import PolicyName
from deepinfer.server.config import ServerConfig
from deepinfer.web.handoff import MAX_LEASE_S


class RouterConfig(BaseModel):
    """Validated router settings; invalid values raise ``ValueError`` naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: tuple[str, ...] = Field((), description="prefill-role worker URLs")
    decode: tuple[str, ...] = Field((), description="decode-role worker URLs")
    both: tuple[str, ...] = Field((), description="aggregated (both-role) worker URLs")
    accept_registrations: bool = Field(
        False,
        description="let workers join with deepinfer serve --register-with (they prove themselves with the "
        "cluster secret, which this needs)",
    )
    api_key: str | None = Field(
        None, min_length=1, repr=False, description="required from clients when set (as deepinfer serve)"
    )
    cluster_secret: str | None = Field(
        None,
        min_length=16,
        repr=False,
        description="the secret shared with the workers (deepinfer.web.auth): sent on every request to a "
        "worker, required from workers that register or deregister",
    )
    deregister_after_s: float = Field(
        10.0,
        gt=0,
        description="a worker that registered itself and stays ejected this long is forgotten (workers named "
        "on the command line are only ejected)",
    )
    model: str | None = Field(None, description="model folder whose tokenizer counts prompt tokens")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    prefill_policy: PolicyName = Field(
        "estimated-compute", description="how prefill-capable workers are chosen"
    )
    prefill_horizon_s: float = Field(
        0.1,
        gt=0,
        description="estimated-compute: a long prompt is placed on a worker only once that worker's expected "
        "prompt backlog is under this many seconds; until then it waits in the router (late binding)",
    )
    prefill_queue_limit: int = Field(
        1024,
        ge=0,
        description="estimated-compute: long prompts that may wait in the router for a worker (beyond: 429); "
        "0 places each request at arrival",
    )
    min_disaggregated_tokens: int = Field(
        512, ge=0, description="prompts shorter than this go straight to a decode-capable worker"
    )
    decode_request_weight_tokens: int = Field(
        256, ge=0, description="decode policy: KV tokens one active request counts as"
    )
    poll_interval_s: float = Field(0.25, gt=0, description="load / health poll period per worker")
    poll_timeout_s: float = Field(2.0, gt=0, description="a load poll slower than this fails")
    eject_after: int = Field(2, ge=1, description="consecutive failed polls that eject a worker")
    connect_timeout_s: float = Field(2.0, gt=0, description="connecting to a worker")
    first_byte_timeout_s: float = Field(
        60.0, gt=0, description="streaming: a worker that sends no output within this is retried elsewhere"
    )
    request_timeout_s: float = Field(600.0, gt=0, description="each request's deadline, retries included")
    max_attempts: int = Field(3, ge=1, description="workers tried per request")
    kv_lease_s: float = Field(
        30.0,
        gt=0,
        le=MAX_LEASE_S,
        description="how long a prefill worker holds handed-off KV blocks for the decode worker",
    )
    max_request_bytes: int = Field(
        ServerConfig.model_fields["max_request_bytes"].default,
        ge=1024,
        description="larger request bodies: 413, before they are read whole (as deepinfer serve)",
    )
    body_timeout_s: float = Field(
        ServerConfig.model_fields["body_timeout_s"].default,
        gt=0,
        description="a request body must arrive within this time: 408 (as deepinfer serve)",
    )
    startup_timeout_s: float = Field(30.0, gt=0, description="how long to wait for the workers at startup")
    log_level: str = "info"

    @field_validator("prefill", "decode", "both")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return tuple(u.rstrip("/") for u in urls)

    @model_validator(mode="after")
    def _registration_needs_the_secret(self) -> Self:
        if self.accept_registrations and self.cluster_secret is None:
            raise ValueError(
                "--accept-registrations: registration needs the cluster secret the workers prove themselves "
                "with: give --cluster-secret-file PATH or set DEEPINFER_CLUSTER_SECRET"
            )
        return self

    def workers(self) -> dict[str, str]:
        """URL -> the option that named it (for error messages)."""
        named: dict[str, str] = {}
        for option, urls in (("--prefill", self.prefill), ("--decode", self.decode), ("--both", self.both)):
            for url in urls:
                if url in named:
                    raise ValueError(f"{option}: {url} is already given with {named[url]}")
                named[url] = option
        return named
