"""What a worker reports to routers: its role, identity and load (``GET /load`` on ``deepinfer serve``).

Two objects, split where the engine core ends:

- :class:`EngineLoad` is read from the engine by :func:`engine_load` on the thread that owns the
  engine (after each step, beside the other engine stats), so it is consistent and cheap: a few sums
  over the scheduler's queues. Host data, plain numbers: it crosses a process boundary as msgspec.
- :class:`WorkerLoad` is what the endpoint serves: the latest ``EngineLoad`` plus what the front
  knows (role, served model name, fingerprints, the step cost model, requests admitted). The router's
  registry polls it (it doubles as the health check) and its policies read it.

Prefill work is kept as the four sums the step cost model is linear in (requests, new tokens,
attention pairs, cached context of multi-token chunks), so whoever holds the coefficients turns it
into seconds: ``StepCostModel.marginal`` summed over requests equals :meth:`PrefillWork.seconds`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from deepinfer.core.roles import Role
from deepinfer.engine.cost_model import StepCostModel, attention_pairs

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.request import Request

LOAD_PATH = "/load"  # for routers: the cluster key opens it (deepinfer.server.middleware)


class PrefillWork(msgspec.Struct, frozen=True):
    """Prompt tokens still to compute, as the sums of the step cost model's terms."""

    requests: int = 0
    tokens: int = 0
    attention_pairs: float = 0.0
    context_tokens: int = 0  # cached tokens before a multi-token remainder (MLA's context expansion)

    @classmethod
    def of(cls, work: Iterable[tuple[int, int]]) -> PrefillWork:
        """From (tokens still to compute, tokens already computed) per request; zero-token entries
        are skipped."""
        requests = tokens = context = 0
        pairs = 0.0
        for new, cached in work:
            if new <= 0:
                continue
            requests += 1
            tokens += new
            pairs += attention_pairs(new, cached)
            context += cached if new > 1 else 0
        return cls(requests, tokens, pairs, context)

    def seconds(self, model: StepCostModel) -> float:
        """Predicted compute time of this work under ``model`` (the sum of its marginal costs)."""
        return (
            model.per_request_s * self.requests
            + model.per_token_s * self.tokens
            + model.per_attention_s * self.attention_pairs
            + model.per_context_s * self.context_tokens
        )


class EngineLoad(msgspec.Struct, frozen=True):
    """The engine's load after its latest step (see the module docstring)."""

    num_running: int = 0
    num_waiting: int = 0
    prefill: PrefillWork = PrefillWork()  # prompt work left in the running and waiting requests
    kv_tokens_held: int = 0  # tokens whose KV the running requests hold
    kv_capacity_tokens: int = 0  # KV blocks x block size
    busy_s: float = 0.0  # time spent in engine steps since start


def combined_load(a: EngineLoad, b: EngineLoad) -> EngineLoad:
    """The load of two engine cores serving as one worker (data-parallel ranks): sums."""
    pa, pb = a.prefill, b.prefill
    prefill = PrefillWork(pa.requests + pb.requests, pa.tokens + pb.tokens, pa.attention_pairs + pb.attention_pairs,
                          pa.context_tokens + pb.context_tokens)  # fmt: skip
    return EngineLoad(
        a.num_running + b.num_running,
        a.num_waiting + b.num_waiting,
        prefill,
        a.kv_tokens_held + b.kv_tokens_held,
        a.kv_capacity_tokens + b.kv_capacity_tokens,
        a.busy_s + b.busy_s,
    )


def _remaining_prompt(request: Request) -> tuple[int, int]:
    computed = min(request.num_computed_tokens, request.num_prompt_tokens)
    return request.num_prompt_tokens - computed, computed


def engine_load(engine: LLMEngine, busy_s: float) -> EngineLoad:
    """Read the load of ``engine``; call on the thread that steps it."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    requests = [*scheduler.running, *scheduler.waiting]
    return EngineLoad(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        prefill=PrefillWork.of(_remaining_prompt(r) for r in requests),
        kv_tokens_held=sum(r.num_computed_tokens for r in scheduler.running),
        kv_capacity_tokens=kv.pool.num_blocks * kv.block_size,
        busy_s=busy_s,
    )


class CostModel(msgspec.Struct, frozen=True):
    """A worker's step cost model on the wire (``StepCostModel``'s coefficients)."""

    overhead_s: float
    per_request_s: float
    per_token_s: float
    per_attention_s: float
    per_context_s: float
    source: str

    @classmethod
    def of(cls, model: StepCostModel) -> CostModel:
        return cls(
            model.overhead_s,
            model.per_request_s,
            model.per_token_s,
            model.per_attention_s,
            model.per_context_s,
            model.source,
        )

    def step_model(self) -> StepCostModel:
        return StepCostModel(
            self.overhead_s,
            self.per_request_s,
            self.per_token_s,
            self.per_attention_s,
            self.per_context_s,
            self.source,
        )


class WorkerLoad(msgspec.Struct, frozen=True):
    """``GET /load``: a worker's identity and load (see the module docstring)."""

    model: str  # the served model name clients send
    model_fingerprint: str  # of config.json + tokenizer.json: same weights layout and tokenizer
    kv_layout: str  # fingerprint of the KV cache layout (block size, tensors, dtype, layers)
    role: Role
    healthy: bool
    num_in_flight: int  # requests the server admitted and has not finished
    engine: EngineLoad
    cost_model: CostModel
    kv_store_id: str = ""  # the shared KV store it hands blocks through ("": none, no handoff)
    kv_leases: int = 0  # handoff leases it holds in that store (deepinfer.server.kv_transfer)

    @property
    def active_requests(self) -> int:
        return max(self.num_in_flight, self.engine.num_running + self.engine.num_waiting)

    @property
    def prefill_backlog_s(self) -> float:
        """Predicted seconds of prompt work queued or running on this worker."""
        return self.engine.prefill.seconds(self.cost_model.step_model())

    @property
    def kv_usage(self) -> float:
        cap = self.engine.kv_capacity_tokens
        return self.engine.kv_tokens_held / cap if cap else 0.0


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def model_fingerprint(model_folder: str | Path, tokenizer_folder: str | Path | None = None) -> str:
    """Fingerprint of a model folder's ``config.json`` and ``tokenizer.json`` (a missing file counts
    as empty): two workers, or a router and a worker, with the same one count tokens alike."""
    model, tok = Path(model_folder), Path(tokenizer_folder or model_folder)
    files = (model / "config.json", tok / "tokenizer.json")
    return _digest(f.read_bytes() if f.is_file() else b"" for f in files)


def kv_layout_fingerprint(engine: LLMEngine) -> str:
    """Fingerprint of the engine's KV cache layout: blocks from one engine are usable by another
    exactly when the two agree."""
    spec = engine.cache_spec
    layout = {
        "block_size": spec.block_size,
        "tensors": [list(t.block_shape) for t in spec.tensors],
        "dtype": str(spec.dtype),
        "layers": engine.model.num_cache_layers,
    }
    return _digest([json.dumps(layout, sort_keys=True).encode()])


def step_cost_model(engine: LLMEngine) -> StepCostModel:
    """The cost model a worker reports: the engine's own (calibrated when it runs with a step time
    budget), else the analytic one from the chip's facts (``source`` says which)."""
    if engine.cost_model is not None:
        return engine.cost_model
    return StepCostModel.from_chip(engine.platform.chip, engine.model_config)
