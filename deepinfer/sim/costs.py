"""Forward-pass cost models for the simulator: what one lockstep step of a worker costs.

The simulator runs the engine's real scheduler; only the model's forward pass is replaced, by one of:

- :class:`CalibratedCost` — the engine's own :class:`~deepinfer.engine.cost_model.StepCostModel`,
  measured on this machine (``deepinfer.worker.calibration`` or a fit to real step times).
- :class:`RooflineCost` — DeepSeek-V3-sized MLA attention, MoE GEMMs and expert-parallel all-to-all,
  each term the larger of its FLOPs over the chip's peak and its bytes over the memory (or link)
  bandwidth, from the chip facts table (``deepinfer.platform.chips``). A worker is one EP group of
  ``ep`` chips, each a data-parallel attention rank, stepping in lockstep: the step lasts as long as
  its slowest rank's attention plus the MoE layers of the whole group.

Both answer ``step_seconds(ranks)`` where ``ranks`` is, for each simulated DP rank of the group, the
list of (new tokens, cached tokens) pairs its scheduler picked; and ``scheduler_model()``, the
:class:`StepCostModel` that rank's scheduler cuts chunks with (the roofline model hands the engine a
model fitted to itself, as the engine's start-up calibration fits one to the real chip).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.engine.cost_model import StepCostModel, Work, attention_pairs
from deepinfer.platform.chips import ChipFacts, SkuFacts, chip_facts


class ForwardCost(Protocol):
    def step_seconds(self, ranks: Sequence[Sequence[Work]]) -> float:
        """Seconds of one lockstep step; ``ranks[i]`` is rank i's (new, cached) work."""

    def runner_seconds(self, ranks: Sequence[Sequence[Work]]) -> float:
        """Of those, what the engine's model runner measures and feeds back to its scheduler's time
        budget (``Scheduler.observe_step_time``)."""

    def scheduler_model(self) -> StepCostModel:
        """The cost model the engine's scheduler on one rank uses for its time budget."""


@dataclass(frozen=True, slots=True)
class CalibratedCost:
    """Measured cost models of one aggregated engine (one rank).

    ``model`` is the scheduler's: the engine's start-up calibration, which cuts prompt chunks to the
    step time budget, as in the engine. ``step`` is the served step's period, from one step's start
    to the next's (scheduling, the forward pass, applying the results and the core loop's messaging),
    and ``runner`` the model runner's share of it (what the engine feeds back to its scheduler): both
    fitted by :func:`deepinfer.sim.validation.fit_served_steps` to real served steps' compositions
    and durations (``deepinfer.core.step_log``). Left out, each is the one before it.

    ``jitter``: measured over predicted runner times of real steps; each runner time fed back is the
    prediction times one of them, drawn at random (seeded by ``seed``). The engine's time budget
    follows the 90th percentile of those ratios (``Scheduler.observe_step_time``), so a host's jitter
    shrinks its prompt chunks, which a clock without it would not show. The clock itself stays the
    expected step time.

    ``batch_residual_s``: seconds added to ``step``'s prediction for a step of ``b`` requests
    (index ``b - 1``; past the end, the last entry): the mean residual, measured minus predicted
    period, of served decode-only steps of that batch size. A served engine's per-request cost is
    not linear in its batch on this CPU host (decode steps rose ~3.5 ms a request from 1 to 3
    requests, less beyond: a line's residuals were -2 to -13 ms at 4-6 requests in three runs), so a
    line through a trace's steps, mostly batches of 1 to 3, overshoots the larger batches of a burst
    and the TPOT tail with them.
    The residual goes to any step of that size, prompt chunk or not (the chunk's own cost is in the
    linear terms)."""

    model: StepCostModel
    step: StepCostModel | None = None
    runner: StepCostModel | None = None
    jitter: tuple[float, ...] = ()
    batch_residual_s: tuple[float, ...] = ()
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def step_seconds(self, ranks: Sequence[Sequence[Work]]) -> float:
        return max(self.period(work) for work in ranks)

    def period(self, work: Sequence[Work]) -> float:
        """One rank's step clock: the step model plus its batch size's residual (never below 0)."""
        seconds = (self.step or self.model).predict(work)
        if self.batch_residual_s and work:
            seconds += self.batch_residual_s[min(len(work), len(self.batch_residual_s)) - 1]
        return max(seconds, 0.0)

    def runner_seconds(self, ranks: Sequence[Sequence[Work]]) -> float:
        seconds = max((self.runner or self.step or self.model).predict(work) for work in ranks)
        return seconds * self._rng.choice(self.jitter) if self.jitter else seconds

    def scheduler_model(self) -> StepCostModel:
        return self.model


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The shapes that set a DeepSeek-family model's cost (defaults: DeepSeek-V3/R1's config.json)."""

    hidden: int = 7168
    layers: int = 61
    dense_layers: int = 3  # first_k_dense_replace
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    dense_intermediate: int = 18432
    moe_intermediate: int = 2048
    routed_experts: int = 256
    experts_per_token: int = 8
    shared_experts: int = 1
    vocab: int = 129280
    weight_bytes: float = 1.0  # FP8 e4m3 weights, as DeepSeek serves them
    kv_bytes: float = 2.0  # bf16 latent cache (FlashMLA's 576-wide rows)
    dispatch_bytes: float = 1.0  # FP8 tokens to the experts (DeepEP), bf16 back
    combine_bytes: float = 2.0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.routed_experts else 0

    @property
    def attention_params(self) -> int:
        """Per layer: q down/up (or q proj), kv down, kv up (W_UK, W_UV), output."""
        d, h = self.hidden, self.heads
        q = d * self.q_lora_rank + self.q_lora_rank * h * (self.qk_nope + self.qk_rope) if self.q_lora_rank else (
            d * h * (self.qk_nope + self.qk_rope)
        )  # fmt: skip
        kv_up = self.kv_lora_rank * h * (self.qk_nope + self.v_head)
        return q + d * (self.kv_lora_rank + self.qk_rope) + kv_up + h * self.v_head * d

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def dense_params(self) -> int:
        """Parameters every token passes on its own rank (all but the routed experts), LM head included."""
        mlp = self.dense_layers * 3 * self.hidden * self.dense_intermediate
        shared = self.moe_layers * self.shared_experts * self.expert_params
        gate = self.moe_layers * self.hidden * self.routed_experts
        return self.layers * self.attention_params + mlp + shared + gate + self.hidden * self.vocab

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * (self.kv_lora_rank + self.qk_rope) * self.kv_bytes


DEEPSEEK_V3 = ModelDims()


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Shares of the datasheet peaks that kernels reach. Defaults from the kernels' own READMEs on
    H800: DeepGEMM FP8 GEMMs ~1,350-1,550 of 1,979 TFLOP/s (0.65); FlashMLA ~3,000 of 3,350 GB/s when
    memory-bound (0.85) and ~580-660 of 989 bf16 TFLOP/s when compute-bound (0.6); DeepEP dispatch/combine
    ~150 GB/s of 200 GB/s NVLink per direction on intranode (0.7 assumed for every link)."""

    gemm: float = 0.65
    attention: float = 0.6
    memory: float = 0.85
    link: float = 0.7
    step_overhead_s: float = 0.5e-3  # launch / host gap per step with graphs (assumed)
    collective_latency_s: float = 20e-6  # per all-to-all (dispatch or combine) per layer (assumed)

    def __post_init__(self) -> None:
        for name in ("gemm", "attention", "memory", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"efficiency.{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """One EP group of ``ep`` chips of ``sku``; each chip a DP attention rank holding all dense weights
    and ``(routed_experts + redundant_experts) / ep`` routed experts per MoE layer.

    ``expert_imbalance`` is max/mean routed tokens per chip (1.0: perfect), from the EPLB placement
    (``deepinfer.sim.policies``). With ``overlap`` (DeepSeek's two-micro-batch overlap) the
    all-to-all hides behind compute; without it, it adds. The ``step_seconds`` input holds only the
    simulated ranks; the group's other ranks are taken to carry the same mean load.
    """

    sku: SkuFacts
    ep: int = 1
    redundant_experts: int = 0
    expert_imbalance: float = 1.0
    dims: ModelDims = DEEPSEEK_V3
    efficiency: Efficiency = Efficiency()
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ValueError(f"ep must be >= 1, got {self.ep}")
        if self.expert_imbalance < 1.0:
            raise ValueError(f"expert_imbalance is max/mean and must be >= 1, got {self.expert_imbalance}")
        if self.dims.routed_experts and (self.dims.routed_experts + self.redundant_experts) % self.ep:
            raise ValueError(
                f"{self.dims.routed_experts} routed + {self.redundant_experts} redundant experts do not "
                f"split evenly over ep={self.ep} chips"
            )
        if self.weight_bytes_per_chip > self.chip.hbm_bytes > 0:
            raise ValueError(
                f"{self.sku.name} at ep={self.ep} needs {self.weight_bytes_per_chip / 1e9:.0f} GB of weights "
                f"per chip, more than its {self.chip.hbm_bytes / 1e9:.0f} GB of HBM; use a wider EP"
            )

    @property
    def chip(self) -> ChipFacts:
        return chip_facts(self.sku.chip)

    @property
    def experts_per_chip(self) -> int:
        return (self.dims.routed_experts + self.redundant_experts) // self.ep

    @property
    def weight_bytes_per_chip(self) -> float:
        d = self.dims
        return (d.dense_params + d.moe_layers * self.experts_per_chip * d.expert_params) * d.weight_bytes

    def kv_capacity_tokens(self, reserve: float = 0.1) -> int:
        """KV tokens one chip holds after its weights and a ``reserve`` share of HBM."""
        free = self.chip.hbm_bytes * (1 - reserve) - self.weight_bytes_per_chip
        return max(0, int(free / self.dims.kv_bytes_per_token))

    # ------------------------------------------------------------------ the terms
    def _peak(self, fp8: bool) -> float:
        tflops = self.chip.fp8_tflops if fp8 and self.chip.fp8_tflops else self.chip.bf16_tflops
        return tflops * 1e12

    def _roof(self, flops: float, nbytes: float, fp8: bool, eff: float) -> float:
        return max(
            flops / (self._peak(fp8) * eff), nbytes / (self.chip.hbm_bytes_per_s * self.efficiency.memory)
        )

    def dense_seconds(self, work: Sequence[Work]) -> float:
        """Attention projections, dense MLPs, shared experts and the LM head on one rank, plus MLA's
        core attention: absorbed (latent MQA, memory-bound on the KV read) for single-token decodes,
        and, for a prompt chunk, the cheaper of that and the expanded form (per-head K and V, which
        also expands the cached context)."""
        d, e = self.dims, self.efficiency
        tokens = sum(n for n, _ in work)
        if tokens == 0:
            return 0.0
        t = self._roof(2 * d.dense_params * tokens, d.dense_params * d.weight_bytes, True, e.gemm)
        decode = [(n, c) for n, c in work if n == 1]
        chunks = [(n, c) for n, c in work if n > 1]
        absorbed_per_pair = 2 * d.layers * d.heads * (2 * d.kv_lora_rank + d.qk_rope)
        if decode:
            pairs = sum(attention_pairs(n, c) for n, c in decode)
            kv = d.kv_bytes_per_token * sum(c + n for n, c in decode)
            t += self._roof(absorbed_per_pair * pairs, kv, False, e.attention)
        expanded_per_pair = 2 * d.layers * d.heads * (2 * d.qk_nope + d.qk_rope + d.v_head)
        expand_per_token = 2 * d.layers * d.kv_lora_rank * d.heads * (d.qk_nope + d.v_head)
        for n, c in chunks:  # each chunk in the cheaper form: a short chunk after a long context absorbs
            pairs = attention_pairs(n, c)
            kv = d.kv_bytes_per_token * (c + n)
            expanded = self._roof(expanded_per_pair * pairs + expand_per_token * c, kv, False, e.attention)
            t += min(expanded, self._roof(absorbed_per_pair * pairs, kv, False, e.attention))
        return t

    def moe_seconds(self, group_tokens: float, rank_tokens: float) -> float:
        """Routed experts of one chip for a group step of ``group_tokens`` tokens, and the all-to-all
        of a rank sending ``rank_tokens`` tokens, over all MoE layers."""
        d, e = self.dims, self.efficiency
        if not d.routed_experts or group_tokens == 0:
            return 0.0
        routed = group_tokens * d.experts_per_token / self.ep * self.expert_imbalance
        touched = min(self.experts_per_chip, routed)  # experts with at least one token (upper bound)
        gemm = self._roof(
            2 * d.expert_params * routed, touched * d.expert_params * d.weight_bytes, True, e.gemm
        )
        remote = 1 - 1 / self.ep
        if remote == 0:
            comm = 0.0
        else:
            per_token = d.experts_per_token * d.hidden * (d.dispatch_bytes + d.combine_bytes)
            nbytes = rank_tokens * per_token * remote
            # Of the remote destinations, those beyond the scale-up domain cross the scale-out network.
            inside = min(self.ep, self.sku.scale_up_chips) - 1
            outside = (self.ep - 1 - inside) / (self.ep - 1)
            link = self.chip.interconnect_bytes_per_s * e.link
            comm = nbytes * (1 - outside) / link + nbytes * outside / (
                self.sku.scale_out_bytes_per_s * e.link
            )
            comm += 2 * e.collective_latency_s
        return d.moe_layers * (max(gemm, comm) if self.overlap else gemm + comm)

    def step_seconds(self, ranks: Sequence[Sequence[Work]]) -> float:
        ranks = [w for w in ranks]
        if not any(ranks):
            return 0.0
        tokens = [sum(n for n, _ in w) for w in ranks]
        mean_tokens = sum(tokens) / len(tokens)
        attention = max(self.dense_seconds(w) for w in ranks)
        return (
            self.efficiency.step_overhead_s + attention + self.moe_seconds(mean_tokens * self.ep, max(tokens))
        )

    def runner_seconds(self, ranks: Sequence[Sequence[Work]]) -> float:
        return self.step_seconds(ranks)  # no host loop modelled apart: the whole step is the runner's

    def scheduler_model(self) -> StepCostModel:
        """A StepCostModel fitted to this roofline on single-rank prompt chunks and decode batches at
        DeepSeek-V3 scale, standing in for the calibration the engine would run on the chip."""
        shapes: list[list[Work]] = [[(n, c)] for n in (256, 1024, 4096, 8192) for c in (0, 4096, 32768)]
        shapes += [[(1, c)] * b for b in (1, 16, 64, 128, 256) for c in (1024, 8192, 32768)]
        samples = [(w, self.step_seconds([w])) for w in shapes]
        fitted = StepCostModel.fit(samples)
        return StepCostModel(
            fitted.overhead_s, fitted.per_request_s, fitted.per_token_s, fitted.per_attention_s,
            fitted.per_context_s, f"roofline fit ({self.sku.key}, ep={self.ep})",
        )  # fmt: skip
