"""Engine configuration: one typed, validated source of truth for ``LLM`` and the CLI."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer.kvstore.config import KVStoreConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]
# What quantised checkpoint weights are held as (deepinfer.model.weight_plan): as stored where the
# backend has kernels for them, or dequantised at load into bfloat16 / float32.
Weights = Literal["as-stored", "bf16", "fp32"]
WEIGHTS_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
WEIGHTS_HELP = (
    "quantised (FP8/MXFP4) checkpoint weights: as-stored keeps them in low precision where the backend has "
    "kernels for them (else dequantises them at load, and says so); bf16 / fp32 dequantise them at load into "
    "that dtype (the model dtype follows)"
)


class EngineConfig(BaseModel):
    """How to run a model. Invalid values raise ``ValueError`` naming the field and the accepted range."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model folder")
    tokenizer: str | None = Field(None, description="tokenizer folder; defaults to the model folder")
    dtype: DType = Field("auto", description="auto: float32 on cpu, the checkpoint's dtype elsewhere")
    weights: Weights = Field(
        "as-stored",
        description="quantised (FP8 / MXFP4) checkpoint weights: as-stored keeps them in low precision where "
        "the backend has kernels for them (else dequantises at load, and says so); bf16 / fp32 dequantise "
        "at load into that dtype (the model dtype follows; an explicit other dtype is an error)",
    )
    accelerator: str | None = Field(None, description="platform name; None reads DEEPINFER_ACCELERATOR")
    max_model_len: int | None = Field(None, ge=2, description="context length; None: the model's maximum")
    max_num_seqs: int = Field(256, ge=1, description="most requests in one step")
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one step")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="largest prompt chunk one request gets per step; None: the step budget"
    )
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        description="KV cache size; None: 90% of free device memory less the peak of one profiled step at "
        "max_num_batched_tokens (at most 4 GiB on cpu)",
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
    graph_capture: bool | None = Field(
        None,
        description="replay decode steps from graphs captured per batch size (CUDA/ACL graphs; on cpu, "
        "recorded ops replayed from C++); None: the platform's default (on with the fast cpu backend)",
    )
    async_scheduling: bool = Field(
        False, description="schedule step N+1 while step N computes (the scheduler runs one step ahead)"
    )
    max_decode_steps: int = Field(
        8,
        ge=1,
        le=64,
        description="decode iterations one step may run back to back when every running request decodes "
        "and none waits, cut to about 4 ms: tokens then arrive up to this many at a time; 1: off (also off "
        "with speculative decoding, async scheduling, a KV store, data parallelism or structured outputs)",
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

    # ---- parallelism: attention data parallelism + MoE expert parallelism (deepinfer.parallel) ----
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="data-parallel ranks: engine cores in one torch.distributed group, each with its "
        "own scheduler and KV cache",
    )
    enable_expert_parallel: bool = Field(
        False, description="shard the routed experts over the data-parallel ranks (EP size = DP size)"
    )
    num_redundant_experts: int = Field(
        0, ge=0, description="extra expert slots per MoE layer, holding replicas of hot experts (EPLB)"
    )
    eplb_interval: int | None = Field(
        None, ge=1, description="rearrange experts by their measured load every this many steps; None: never"
    )
    eplb_window: int = Field(1000, ge=1, description="steps of expert-load history a rearrangement weighs")
    eplb_min_gain: float = Field(
        0.05,
        ge=0.0,
        description="rearrange only when predicted balance (mean/max rank load) rises by more than this "
        "plus eplb_gain_per_gib for every GiB of expert weights moved",
    )
    eplb_gain_per_gib: float = Field(0.01, ge=0.0, description="balance gain demanded per GiB moved")
    nnodes: int = Field(1, ge=1, description="hosts the data-parallel ranks span")
    node_rank: int = Field(0, ge=0, description="this host's index among nnodes")
    master_addr: str | None = Field(
        None, description="rendezvous address of node 0 (needed when nnodes > 1); None on one host: loopback"
    )
    master_port: int | None = Field(None, ge=1, le=65535, description="rendezvous port; None: a free port")
    dp_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a collective waiting longer than this fails: a dead or hung rank is an error",
    )

    @model_validator(mode="after")
    def _check_weights(self) -> EngineConfig:
        wanted = WEIGHTS_DTYPES.get(self.weights)
        if wanted is not None and self.dtype not in ("auto", wanted):
            raise ValueError(
                f"weights={self.weights!r} dequantises into {wanted}, but dtype={self.dtype!r}: leave dtype "
                f"'auto' or give {wanted!r}"
            )
        return self

    @model_validator(mode="after")
    def _check_parallel(self) -> EngineConfig:
        dp = self.data_parallel_size
        if not self.enable_expert_parallel:
            for name in ("num_redundant_experts", "eplb_interval"):
                if getattr(self, name):
                    raise ValueError(f"{name} needs enable_expert_parallel=True")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError("master_addr is required when nnodes > 1: the rendezvous address of node 0")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if dp % self.nnodes:
            raise ValueError(f"data_parallel_size={dp} does not divide evenly over nnodes={self.nnodes}")
        if dp > 1:
            for name in ("speculative", "graph_capture", "async_scheduling"):
                if getattr(self, name):
                    raise ValueError(f"{name} does not combine with data_parallel_size > 1 yet")
            if self.step_time_budget_ms is not None and self.cost_model == "calibrate":
                raise ValueError(
                    "step_time_budget_ms with cost_model='calibrate' does not combine with "
                    "data_parallel_size > 1 yet; use cost_model='chip'"
                )
        return self
