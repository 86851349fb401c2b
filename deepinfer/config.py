"""Engine configuration: one typed, validated source of truth for ``LLM`` and the CLI."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.kvstore.config import KVStoreConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """How to run a model. Invalid values raise ``ValueError`` naming the field and the accepted range."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model folder")
    tokenizer: str | None = Field(None, description="tokenizer folder; defaults to the model folder")
    dtype: DType = Field("auto", description="auto: float32 on cpu, the checkpoint's dtype elsewhere")
    accelerator: str | None = Field(None, description="platform name; None reads DEEPINFER_ACCELERATOR")
    max_model_len: int | None = Field(None, ge=2, description="context length; None: the model's maximum")
    max_num_seqs: int = Field(256, ge=1, description="most requests in one step")
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one step")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="largest prompt chunk one request gets per step; None: the step budget"
    )
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV cache size; None: 90% of free device memory (at most 4 GiB on cpu)"
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="exact number of KV blocks (overrides the size)"
    )
    seed: int = Field(0, description="seeds requests that carry no seed of their own")
    step_time_budget_ms: float | None = Field(
        None,
        gt=0,
        description="cut prompt chunks so each step's predicted time fits; None: fixed-size chunks",
    )
    graph_capture: bool = Field(
        False,
        description="replay decode steps from device graphs captured per padded batch size (CUDA/ACL graphs; "
        "on cpu the wrapper re-runs eagerly)",
    )
    async_scheduling: bool = Field(
        False, description="schedule step N+1 while step N computes (the scheduler runs one step ahead)"
    )
    speculative: Literal["mtp", "mtp-confidence"] | None = Field(
        None, description="speculative decoding: MTP drafts, optionally gated by the model's confidence head"
    )
    num_draft_tokens: int | None = Field(
        None,
        ge=1,
        le=16,
        description="drafts per request per step; None: the model's MTP layer count (mtp), the "
        "chain length its confidence head was trained on (mtp-confidence)",
    )
    confidence_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="mtp-confidence: verify drafts while predicted acceptance >= this"
    )
    deterministic: bool | None = Field(
        None,
        description="batch-invariant mode: a request's logits, bit for bit, do not depend on its batch mates, "
        "its prompt's chunking, prefix-cache hits or speculative decoding; None reads DEEPINFER_DETERMINISTIC",
    )
    cost_model: Literal["calibrate", "chip"] = Field(
        "calibrate",
        description="step cost model: measured on the model at startup (cached) or from chip facts",
    )
    detokenize: bool = Field(
        True,
        description="build output text in the engine; False leaves it to the caller (the server's API front "
        "detokenizes; stop strings are still matched in the engine)",
    )
    # KV store (deepinfer/kvstore): tiers beyond the device cache; None: off.
    kv_store: KVStoreConfig | None = Field(
        None, description="host-memory / disk / shared KV store with retention by traffic class"
    )
