"""The capacity and cost planner: search deployments, simulate the promising ones, keep the cheapest
that meets the SLOs.

How a search runs (and how it scales to a cluster it cannot simulate whole):

1. **Day-level cache stage** (request level, no scheduler): the workload's sessions over
   ``cache_horizon_s`` at a small share of the traffic, through the host and store tiers of each
   store size x TTL option; a tier's capacity is scaled by the same share (sessions are independent,
   so a 1/k slice of the sessions in a 1/k slice of the store sees the same TTL behaviour and about
   the same capacity evictions). Gives the hit rate by tier, occupancy over time, and the cached and
   uncached input tokens per day.
2. **Sizing**: for each EP width, the roofline gives the largest decode batch per rank whose step
   fits the TPOT target and the prefill rate per chip at the workload's uncached prompt; that sizes
   the prefill and decode pools for the peak hour. Candidates are these sizes and larger ones.
3. **Step stage** (the engine's real scheduler, the router's policies, the store's retention): a
   share of the peak-hour traffic through a few ranks of each pool after ``cache_warm_s`` of
   cache-only history, the trace starting with the sessions a steady state has in progress (so
   the window carries the peak hour's request rate, later turns included); a pool whose share is not a whole number of ranks runs the next whole number
   with proportionally slower forward passes, so its capacity is exact. Prefill is sized first by
   *TTFT screens* (``prefill_ranks`` prefill ranks, every request ending at its first token: a
   two-hop request's TTFT does not depend on the decode pool, and the screen costs a fraction of a
   whole-cluster run), bisecting in EP groups; then decode by *whole-cluster* runs
   (``decode_ranks`` decode ranks), bisecting on the TPOT/ITL targets (:meth:`Planner.plan`).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.engine.cost_model import StepCostModel, Work
from deepinfer.kvstore.retention import HIGH_WATERMARK
from deepinfer.platform.chips import SkuFacts, sku_facts
from deepinfer.sim.cachesim import CacheStage, run_cache_stage
from deepinfer.sim.cluster import ClusterConfig, EngineKnobs, PoolConfig, Simulation
from deepinfer.sim.costs import DEEPSEEK_V3, ForwardCost, RooflineCost
from deepinfer.sim.policies import (
    TierRetention,
    expert_imbalance,
    identity_placement,
    retention_policy,
    synthetic_expert_load,
)
from deepinfer.sim.report import summarise
from deepinfer.sim.tiers import Tier, TieredStore
from deepinfer.sim.workload import WorkloadSpec, arrivals

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
SLO_METRICS = tuple(f"{m}_{q}" for m in ("ttft", "tpot", "itl") for q in ("mean", "p50", "p90", "p99"))


class NoDeploymentMeetsSLO(Exception):
    """No searched deployment met every target; names the closest and what it misses by."""

    def __init__(self, message: str, closest: dict) -> None:
        super().__init__(message)
        self.closest = closest


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft_p99=2s,tpot_p99=50ms"`` -> ``{"ttft_p99": 2.0, "tpot_p99": 0.05}``."""
    targets = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"([a-z0-9_]+)=([0-9.]+(?:e-?[0-9]+)?)(s|ms|us)", part)
        if match is None:
            raise ValueError(f"SLO term {part!r} is not METRIC=NUMBER(s|ms|us), e.g. ttft_p99=2s")
        name, value, unit = match.groups()
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; known: {', '.join(SLO_METRICS)}")
        if float(value) <= 0:
            raise ValueError(f"SLO {name} must be positive, got {value}{unit}")
        targets[name] = float(value) * _UNITS[unit]
    if not targets:
        raise ValueError("the SLO is empty; give e.g. ttft_p99=2s,tpot_p99=50ms")
    return targets


class PlanOptions(BaseModel):
    """Search and simulation settings (defaults keep a plan under a minute or two on a laptop)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    usd_per_chip_hour: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="rental price; None: the SKU table's"
    )
    usd_per_tb_day: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="KV storage price; None: storage not priced"
    )
    host_gb_per_chip: float = Field(256, ge=0, description="host DRAM for the KV host tier, per prefill chip")
    host_read_bytes_per_s: float = Field(50e9, gt=0, description="host -> device (PCIe 5 x16, ~64 GB/s peak)")
    store_tb_options: list[float] | None = Field(None, description="total store sizes; None: 3 derived sizes")
    ttl_scales: list[float] = Field([1.0, 0.25], min_length=1, description="factors on each class's TTL")
    prefill_ep_options: list[int] = Field([8, 16], min_length=1)
    decode_ep_options: list[int] = Field([32, 64], min_length=1)
    expert_skew_sigma: float = Field(0.5, ge=0, description="lognormal sigma of expert popularity (assumed)")
    cache_horizon_s: float = Field(86400, gt=0)
    cache_requests: int = Field(15000, ge=1000, description="requests the day-level cache stage simulates")
    cache_warm_s: float = Field(600, ge=0, description="cache-only history before a step-stage window")
    window_s: float = Field(20, gt=0, description="arrivals measured (after the warm-up)")
    warmup_s: float = Field(6, ge=0)
    drain_s: float = Field(12, ge=0, description="run on (arrivals continuing) so measured requests finish")
    decode_ranks: int = Field(2, ge=1, description="decode ranks simulated with the real scheduler")
    prefill_ranks: int = Field(8, ge=1, description="prefill ranks simulated by a TTFT screen")
    screen_drain_s: float = Field(
        4, ge=0, description="a TTFT screen's run-on (requests end at their first token)"
    )
    prefill_screens: int = Field(6, ge=1, description="TTFT screens (prefill pool only) sizing prefill")
    max_simulations: int = Field(4, ge=1, description="whole-cluster simulations sizing decode")
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Deployment:
    sku: str
    prefill_chips: int
    prefill_ep: int
    decode_chips: int
    decode_ep: int
    store_tb: float
    ttl_scale: float

    @property
    def chips(self) -> int:
        return self.prefill_chips + self.decode_chips

    def describe(self) -> str:
        return (
            f"{self.prefill_chips} prefill (EP{self.prefill_ep}) + {self.decode_chips} decode (EP{self.decode_ep}) "
            f"{self.sku}, store {self.store_tb:,.1f} TB, TTL x{self.ttl_scale:g}"
        )


@dataclass(slots=True)
class Evaluation:
    deployment: Deployment
    usd_per_day: float
    result: dict
    misses: dict[str, float] = field(default_factory=dict)  # metric -> measured / target (> 1 misses)

    @property
    def meets(self) -> bool:
        return not self.misses

    @property
    def goodput_per_chip(self) -> float:
        return self.result["output_tokens_per_s_per_chip"]


class _Scaled:
    """A forward cost slowed by ``factor`` (a whole number of simulated ranks standing for fewer)."""

    def __init__(self, inner: ForwardCost, factor: float) -> None:
        self.inner, self.factor = inner, factor

    def step_seconds(self, ranks) -> float:
        return self.inner.step_seconds(ranks) * self.factor

    def runner_seconds(self, ranks) -> float:
        return self.inner.runner_seconds(ranks) * self.factor

    def scheduler_model(self) -> StepCostModel:
        m = self.inner.scheduler_model()
        f = self.factor
        return StepCostModel(
            m.overhead_s * f, m.per_request_s * f, m.per_token_s * f, m.per_attention_s * f,
            m.per_context_s * f, m.source,
        )  # fmt: skip


class Planner:
    def __init__(self, spec: WorkloadSpec, sku: str, slo: dict[str, float], options: PlanOptions) -> None:
        self.spec, self.slo, self.options = spec, slo, options
        self.sku: SkuFacts = sku_facts(sku)
        price = options.usd_per_chip_hour or self.sku.usd_per_chip_hour
        if price is None:
            raise ValueError(
                f"no published rental price for {sku!r} in the chip table; pass --usd-per-chip-hour"
            )
        self.price = price
        hourly = [
            sum(c.rate_per_s * (c.time_of_day or [1.0] * 24)[h] for c in spec.classes) for h in range(24)
        ]
        self.peak_hour = max(range(24), key=lambda h: hourly[h])
        self.peak_rate = hourly[self.peak_hour]
        self.mean_rate = statistics.fmean(hourly)
        self.kv_bytes = DEEPSEEK_V3.kv_bytes_per_token
        self._costs: dict[int, RooflineCost] = {}
        self.log: list[str] = []

    # ------------------------------------------------------------------ stage 1: the cache
    def _tiers(self, host_bytes: float, store_bytes: float, ttl_scale: float) -> TieredStore:
        """Host and store tiers under the KV store's retention policy with the classes' TTLs scaled."""
        policy = retention_policy(self._ttl_spec(ttl_scale).ttls)
        tiers = []
        if host_bytes > 0:
            tiers.append(Tier("host", TierRetention(policy, host_bytes), self.options.host_read_bytes_per_s))
        tiers.append(Tier("store", TierRetention(policy, store_bytes), self.sku.scale_out_bytes_per_s))
        return TieredStore(tiers, self.kv_bytes)

    def _ttl_spec(self, scale: float, start_hour: float | None = None) -> WorkloadSpec:
        classes = [c.model_copy(update={"ttl_s": c.ttl_s * scale}) for c in self.spec.classes]
        update = {"classes": classes}
        if start_hour is not None:
            update["start_hour"] = start_hour
        return self.spec.model_copy(update=update)

    def cache_stage(self, store_tb: float, ttl_scale: float, prefill_chips: int) -> CacheStage:
        o = self.options
        share = min(1.0, o.cache_requests / (self.mean_rate * o.cache_horizon_s))
        store = self._tiers(
            o.host_gb_per_chip * 1e9 * prefill_chips * share, store_tb * 1e12 * share, ttl_scale
        )
        return run_cache_stage(self._ttl_spec(ttl_scale), store, o.cache_horizon_s, share, o.seed)

    # ------------------------------------------------------------------ stage 2: sizing
    def _imbalance(self, ep: int) -> float:
        d = DEEPSEEK_V3
        load = synthetic_expert_load(
            d.moe_layers, d.routed_experts, self.options.expert_skew_sigma, self.options.seed
        )
        return expert_imbalance(identity_placement, load, d.routed_experts, 8, 1, ep)

    def _cost(self, ep: int) -> RooflineCost:
        if ep not in self._costs:
            self._costs[ep] = RooflineCost(self.sku, ep=ep, expert_imbalance=self._imbalance(ep))
        return self._costs[ep]

    def _decode_batches(self, cache: CacheStage, decode_ep: int) -> tuple[list[tuple[int, float]], float]:
        """Decode batches at the workload's mean context that fit a rank's KV cache and its
        sequence slots (256): (batch, output tokens/s per chip) of those whose step is within 80% of
        the TPOT target (batch 1 always), ascending; and the most tokens/s of any within the target."""
        decode = self._cost(decode_ep)
        context = int(cache.mean_prompt_tokens + cache.mean_output_tokens / 2)
        target = min(self.slo.get(k, math.inf) for k in ("tpot_p50", "tpot_p90", "tpot_p99", "tpot_mean"))
        capacity = decode.kv_capacity_tokens() // max(1, context)
        out = []
        for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256):
            step = decode.step_seconds([[(1, context)] * b])
            if b == 1 or (b <= capacity and step <= target):
                out.append((b, b / step, step))
        return [(b, rate) for b, rate, step in out if b == 1 or step <= 0.8 * target], max(
            r for _, r, _ in out
        )

    PRUNE_MARGIN = 2.0  # the mean-context roofline understates a decode rank's rate by up to ~1.5x

    def decode_miss(self, cache: CacheStage, d: Deployment) -> float | None:
        """Analytic pre-screen: needed / attainable output tokens/s per decode chip, when the pool
        needs more than ``PRUNE_MARGIN`` times what any batch meeting the TPOT target attains at
        the mean context (None: it may meet it; simulate it)."""
        _, ceiling = self._decode_batches(cache, d.decode_ep)
        need = self.peak_rate * cache.mean_output_tokens / d.decode_chips
        return need / ceiling if need > self.PRUNE_MARGIN * ceiling else None

    def size(self, cache: CacheStage, prefill_ep: int, decode_ep: int) -> tuple[int, int, int]:
        """(prefill chips, decode chips, decode batch per rank) for the peak hour."""
        batches, _ = self._decode_batches(cache, decode_ep)
        batch, rate = batches[-1]
        out_per_s = self.peak_rate * cache.mean_output_tokens
        decode_chips = decode_ep * max(1, math.ceil(out_per_s / rate / decode_ep))
        prefill = self._cost(prefill_ep)
        hit = cache.cached_tokens_per_day / cache.input_tokens_per_day
        uncached = max(1, int(cache.mean_prompt_tokens * (1 - hit)))
        cached = int(cache.mean_prompt_tokens * hit)
        chunk = min(uncached, 8192)
        per_chip = chunk / prefill.step_seconds([[(chunk, cached)]])
        need = self.peak_rate * uncached / per_chip / 0.6  # keep prefill ~60% busy at the peak (queueing)
        prefill_chips = prefill_ep * max(1, math.ceil(need / prefill_ep))
        return prefill_chips, decode_chips, batch

    # ------------------------------------------------------------------ stage 3: simulate
    def simulate(self, d: Deployment, ttft_only: bool = False) -> dict:
        """The step stage for ``d``: a share of the peak-hour traffic through a few ranks of each pool
        (the engine's scheduler, the router's policies, the store's retention).

        Whole cluster (``ttft_only`` False): ``decode_ranks`` decode ranks and the matching share of
        prefill ranks. TTFT screen: ``prefill_ranks`` prefill ranks and the matching share of decode
        ranks, every request ending at its first token. A two-hop request's first token is sampled
        on its prefill rank, which nothing downstream feeds back into (no back-pressure), so the
        screen's TTFTs are those of the whole cluster at the same share, for a fraction of the decode
        steps; it also takes a larger share (more samples for a tail percentile) at the same cost.
        A pool whose share is not a whole number of ranks runs the next whole number, split evenly
        over its EP groups, with proportionally slower forward passes, so its capacity is exact.
        The trace starts with the sessions a steady state has in progress (``arrivals(...,
        steady_state=True)``): from a cold start, a class's later turns, hours apart for chat, would
        be missing and the window would carry a fraction of the peak hour's requests."""
        o = self.options
        if ttft_only:
            share = min(1.0, o.prefill_ranks / d.prefill_chips)
        else:
            share = min(o.decode_ranks, d.decode_chips) / d.decode_chips
        prefill_cost = self._cost(d.prefill_ep)
        decode_cost = self._cost(d.decode_ep)
        block = 64
        prefill_knobs = EngineKnobs(
            num_blocks=prefill_cost.kv_capacity_tokens() // block, block_size=block,
            max_num_batched_tokens=16384, step_time_budget_s=0.5, max_num_seqs=64,
        )  # fmt: skip
        decode_knobs = EngineKnobs(
            num_blocks=decode_cost.kv_capacity_tokens() // block, block_size=block,
            max_num_batched_tokens=2048, max_num_seqs=256,
        )  # fmt: skip
        prefill, p_sim = _pool("prefill", share * d.prefill_chips, d.prefill_ep, prefill_cost, prefill_knobs)
        decode, d_sim = _pool("decode", share * d.decode_chips, d.decode_ep, decode_cost, decode_knobs)
        start = (self.peak_hour - o.cache_warm_s / 3600) % 24
        store = self._tiers(
            o.host_gb_per_chip * 1e9 * share * d.prefill_chips, d.store_tb * 1e12 * share, d.ttl_scale
        )
        config = ClusterConfig(
            [prefill, decode], store=store, kv_transfer_bytes_per_s=self.sku.scale_out_bytes_per_s * 0.7,
            kv_bytes_per_token=self.kv_bytes,
        )  # fmt: skip
        sim = Simulation(config)
        end = o.cache_warm_s + o.window_s
        drain = o.screen_drain_s if ttft_only else o.drain_s
        trace = arrivals(
            self._ttl_spec(d.ttl_scale, start), end + drain, o.seed + 1, share, steady_state=True
        )
        # Cache-only history (the last turn before 0 of each session in progress in the steady state,
        # then the first cache_warm_s), then the window through the scheduler at the full request rate.
        window = []
        for arrival in trace:
            if arrival.time < o.cache_warm_s:
                store.lookup(arrival, 0, arrival.time)
                store.write(arrival, arrival.time)
            else:
                window.append(replace(arrival, output_tokens=1) if ttft_only else arrival)
        sim.env.run(until=o.cache_warm_s)
        sim.run(window, until=end + drain)
        chips = share * d.chips
        result = summarise(sim, o.cache_warm_s + o.warmup_s, end, chips)
        result["simulated"] = {"kind": "ttft screen" if ttft_only else "whole cluster", "prefill_ranks": p_sim,
                               "decode_ranks": d_sim, "chips_represented": chips, "traffic_share": share,
                               "routes": dict(sim.router.routes)}  # fmt: skip
        return result

    def usd_per_day(self, d: Deployment) -> float:
        storage = d.store_tb * self.options.usd_per_tb_day if self.options.usd_per_tb_day is not None else 0.0
        return d.chips * self.price * 24 + storage

    def check(self, result: dict, ttft_only: bool = False) -> dict[str, float]:
        """SLO -> measured / target for each missed target (a TTFT screen checks the TTFT ones)."""
        misses = {}
        for name, target in self.slo.items():
            metric, stat = name.rsplit("_", 1)
            if ttft_only and metric != "ttft":
                continue
            value = result[f"{metric}_s"][stat]
            if not value <= target:  # NaN (nothing finished) misses too
                misses[name] = value / target if value == value else math.inf
        if result["requests_finished"] < 0.8 * result["requests_arrived"]:
            misses["finished_share"] = result["requests_arrived"] / max(1, result["requests_finished"])
        return misses

    # ------------------------------------------------------------------ the search
    def cache_options(self) -> dict[tuple[float, float], CacheStage]:
        """Store size x TTL options and their cache stages. Unpriced storage makes the largest store
        and the longest TTL dominant, so only that one runs."""
        o = self.options
        host_chips = o.prefill_ep_options[0] * 8
        unbounded = self.cache_stage(math.inf, max(o.ttl_scales), host_chips)
        # The largest derived size holds the unbounded run's peak under the store's high watermark:
        # it never evicts, so that run is its cache stage.
        peak_tb = math.ceil(max(occ["store"] for _, occ in unbounded.occupancy_tb) / HIGH_WATERMARK * 10) / 10
        sizes = o.store_tb_options or [round(peak_tb * f, 1) for f in (0.25, 0.5, 1.0)]
        if o.usd_per_tb_day is None:
            largest = (max(sizes), max(o.ttl_scales))
            if o.store_tb_options is None:
                return {largest: unbounded}
            return {largest: self.cache_stage(*largest, host_chips)}
        return {(size, t): self.cache_stage(size, t, host_chips) for size in sizes for t in o.ttl_scales}

    def plan(self) -> dict:
        """Size analytically, then search each pool by simulation, in units of its EP group:

        1. prefill: TTFT screens (:meth:`simulate` with ``ttft_only``) from the analytic size, growing
           by the miss until one meets every TTFT target, then bisecting between the largest size
           that missed and the smallest that met (at most ``prefill_screens``);
        2. decode: whole-cluster simulations at that prefill size, the same way on the TPOT/ITL
           targets and the finished share (at most ``max_simulations``); one that misses a TTFT
           target there grows the prefill pool instead, unless growing it did not shorten the TTFT
           (by 10%): then the requests wait on the decode pool, which grows.

        Returns the cheapest deployment that met every target in a whole-cluster simulation."""
        t0 = time.perf_counter()
        o = self.options
        caches = self.cache_options()
        analytic = []
        for (store_tb, scale), cache in caches.items():
            for pep in o.prefill_ep_options:
                for dep in o.decode_ep_options:
                    p, dchips, _ = self.size(cache, pep, dep)
                    analytic.append(Deployment(self.sku.key, p, pep, dchips, dep, store_tb, scale))
        analytic.sort(key=lambda c: (self.usd_per_day(c), c.chips))
        d = analytic[0]
        screens: list[Evaluation] = []
        evaluations: list[Evaluation] = []

        def screen(units: int) -> tuple[bool, float]:
            e = self._evaluate(replace(d, prefill_chips=units * d.prefill_ep), True)
            screens.append(e)
            return e.meets, max(e.misses.values(), default=1.0)

        prefill_units = _bisect(d.prefill_chips // d.prefill_ep, screen, o.prefill_screens)
        d = replace(d, prefill_chips=prefill_units * d.prefill_ep)
        best: Evaluation | None = None

        pruned: list[dict] = []
        cache = caches[(d.store_tb, d.ttl_scale)]

        def whole(units: int) -> tuple[bool, float]:
            nonlocal d, best
            miss = self.decode_miss(cache, replace(d, decode_chips=units * d.decode_ep))
            if miss is not None:
                pruned.append({"deployment": replace(d, decode_chips=units * d.decode_ep).describe(),
                               "decode_output_rate_needed_over_attainable": miss})  # fmt: skip
                return False, miss
            before_growth: tuple[Deployment, float] | None = None  # prefill size before it grew, its miss
            while True:
                e = self._evaluate(replace(d, decode_chips=units * d.decode_ep), False)
                evaluations.append(e)
                if e.meets and (best is None or e.usd_per_day < best.usd_per_day):
                    best = e
                ttft = max((v for k, v in e.misses.items() if k.startswith("ttft")), default=None)
                if ttft is None:
                    break
                if before_growth is not None and ttft > 0.9 * before_growth[1]:
                    # A larger prefill pool did not shorten the TTFT: requests wait on the decode pool
                    # (its KV or sequence slots), so keep the smaller prefill pool and grow decode.
                    d = before_growth[0]
                    return False, ttft
                if len(evaluations) >= o.max_simulations:
                    break
                before_growth = (d, ttft)
                grown = math.ceil(d.prefill_chips / d.prefill_ep * _growth(ttft))
                d = replace(d, prefill_chips=grown * d.prefill_ep)
            decode = {k: v for k, v in e.misses.items() if not k.startswith("ttft")}
            return not decode, max(decode.values(), default=1.0)

        _bisect(
            d.decode_chips // d.decode_ep, whole, o.max_simulations, lambda: len(evaluations) + len(pruned)
        )
        elapsed = time.perf_counter() - t0
        if best is None:
            closest = min(evaluations, key=lambda e: max(e.misses.values()))
            detail = ", ".join(
                f"{k} {v:.2f}x the target"
                if k != "finished_share"
                else f"{1 - 1 / v:.0%} of requests unfinished"
                for k, v in closest.misses.items()
            )
            raise NoDeploymentMeetsSLO(
                f"no deployment meets the SLO ({', '.join(f'{k}={v:g}s' for k, v in self.slo.items())}) among "
                f"{len(evaluations)} simulated; closest: {closest.deployment.describe()} misses by {detail}",
                {"deployment": asdict(closest.deployment), "misses": closest.misses},
            )
        report = self._report(best, cache, screens, evaluations, caches, analytic, elapsed)
        report["pruned_analytically"] = pruned
        return report

    def _evaluate(self, d: Deployment, ttft_only: bool) -> Evaluation:
        result = self.simulate(d, ttft_only)
        return Evaluation(d, self.usd_per_day(d), result, self.check(result, ttft_only))

    def _report(
        self, best: Evaluation, cache: CacheStage, screens, evaluations, caches, analytic, elapsed: float
    ) -> dict:
        d = best.deployment
        day = 86400
        output_per_day = self.mean_rate * cache.mean_output_tokens * day
        cached = cache.cached_tokens_per_day
        uncached = cache.input_tokens_per_day - cached
        chip_day = self.price * 24
        storage = (
            d.store_tb * self.options.usd_per_tb_day if self.options.usd_per_tb_day is not None else None
        )
        ceiling = output_per_day_at_peak_load(self.peak_rate, cache.mean_output_tokens)
        return {
            "deployment": asdict(d) | {"description": d.describe(), "chips": d.chips},
            "slo": self.slo,
            "slo_measured": {k: best.result[f"{k.rsplit('_', 1)[0]}_s"][k.rsplit("_", 1)[1]] for k in self.slo},
            "usd_per_chip_hour": self.price,
            "usd_per_day": best.usd_per_day,
            "output_tokens_per_day": output_per_day,
            "input_tokens_per_day": cache.input_tokens_per_day,
            "cached_input_tokens_per_day": cached,
            "output_tokens_per_day_capacity_at_peak_load": ceiling,
            "usd_per_m_output": d.decode_chips * chip_day / output_per_day * 1e6,
            "usd_per_m_input_uncached": d.prefill_chips * chip_day / uncached * 1e6 if uncached else None,
            "usd_per_m_input_cached": storage / cached * 1e6 if storage is not None and cached else None,
            "cache_hit_rate": cache.hit_rate,
            "hourly_cache_hit_rate": cache.hourly_hit_rate,
            "store_occupancy_tb": cache.occupancy_tb,
            "peak_hour_utc": self.peak_hour,
            "peak_requests_per_s": self.peak_rate,
            "simulation": {k: v for k, v in best.result.items() if k != "occupancy_bytes"},
            "evaluated": [
                {"deployment": e.deployment.describe(), "usd_per_day": e.usd_per_day, "meets": e.meets,
                 "misses": e.misses, "output_tokens_per_s_per_chip": e.goodput_per_chip,
                 "tokens_per_s_per_user": e.result["tokens_per_s_per_user"],
                 "ttft_p99_s": e.result["ttft_s"]["p99"], "tpot_p99_s": e.result["tpot_s"]["p99"]}
                for e in evaluations
            ],
            "ttft_screens": [
                {"deployment": e.deployment.describe(), "meets": e.meets, "misses": e.misses,
                 "ttft_p99_s": e.result["ttft_s"]["p99"], "requests": e.result["requests_arrived"]}
                for e in screens
            ],
            "cache_options": {f"{s} TB x{t}": c.hit_rate for (s, t), c in caches.items()},
            "analytic_candidates": [
                {"deployment": c.describe(), "usd_per_day": self.usd_per_day(c)} for c in analytic
            ],
            "elapsed_s": elapsed,
        }  # fmt: skip


def output_per_day_at_peak_load(peak_requests_per_s: float, mean_output_tokens: float) -> float:
    """Output tokens a day at the peak hour's request rate: the load the chosen deployment was
    simulated to serve within the SLO (a steady-state peak-hour trace), so a lower bound on its
    capacity, and never below the day's output (the same requests at the mean rate). Hand-computed:
    40 requests/s of 100 output tokens is 40 x 100 x 86,400 = 345.6 M tokens a day.

    (It was the simulated output rate per chip times the decode chips, while that rate divides by
    every chip, prefill and decode; and a window of a few seconds, which starts with an empty
    decode pool, measures below the load it serves.)"""
    return peak_requests_per_s * mean_output_tokens * 86400


def _growth(miss: float) -> float:
    """How much larger to make a pool that missed its target by ``miss`` (measured / target)."""
    return min(2.0, max(1.25, miss))


def _pool(
    role: str, exact_ranks: float, ep: int, cost: ForwardCost, knobs: EngineKnobs
) -> tuple[PoolConfig, int]:
    """A pool of the next whole number of ranks at or above ``exact_ranks`` (at least one), split
    evenly over EP groups of at most ``ep`` ranks, forward passes slowed by simulated / exact ranks so
    that its capacity is that of ``exact_ranks``. Returns the pool and its simulated ranks."""
    ranks = max(1, math.ceil(exact_ranks - 1e-9))
    workers = math.ceil(ranks / ep)
    per_worker = math.ceil(ranks / workers)
    factor = workers * per_worker / exact_ranks
    scaled = cost if abs(factor - 1) < 1e-9 else _Scaled(cost, factor)
    return PoolConfig(role, workers, per_worker, scaled, knobs), workers * per_worker


def _bisect(start: int, meets, budget: int, used=None) -> int:
    """The smallest size (>= 1) for which ``meets(size) -> (ok, miss)`` holds, searched from
    ``start``: grow by the miss until one meets, then bisect between the largest size that missed
    and the smallest that met. ``used()`` counts evaluations spent (default: calls); stops when it
    reaches ``budget``. Returns the smallest size found to meet, or the last one tried if none did."""
    calls = 0
    used = used or (lambda: calls)
    failed, passed, size = 0, None, max(1, start)
    while used() < budget:
        calls += 1
        ok, miss = meets(size)
        if ok:
            passed = size
        else:
            failed = max(failed, size)
        if passed is None:
            size = max(size + 1, math.ceil(size * _growth(miss)))
        elif passed - failed <= 1:
            break
        else:
            size = (failed + passed) // 2 if failed else max(1, passed // 2)
    return passed if passed is not None else size


def plot(report: dict, path: Path, pareto: list[tuple[float, float, str]]) -> None:
    """Cost against goodput of every simulated deployment, and the per-user vs per-chip Pareto."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for e in report["evaluated"]:
        left.scatter(
            e["output_tokens_per_s_per_chip"], e["usd_per_day"], c="tab:green" if e["meets"] else "tab:red"
        )
    left.set_xlabel("goodput (output tokens/s per chip, simulated at the peak hour)")
    left.set_ylabel("US$ per day")
    left.set_title("cost vs goodput (green: meets the SLO)")
    for label in sorted({p[2] for p in pareto}):
        xs = [p[0] for p in pareto if p[2] == label]
        ys = [p[1] for p in pareto if p[2] == label]
        right.plot(xs, ys, marker="o", label=label)
    right.set_xlabel("tokens/s per user")
    right.set_ylabel("tokens/s per chip")
    right.set_title("decode Pareto (roofline, by EP width)")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def decode_pareto(planner: Planner, context: int) -> list[tuple[float, float, str]]:
    """Per-user vs per-chip decode tokens/s over batch sizes, for each decode EP option."""
    points = []
    for ep in planner.options.decode_ep_options:
        cost = planner._cost(ep)
        for b in (1, 4, 16, 32, 64, 128, 256):
            work: list[Work] = [(1, context)] * b
            t = cost.step_seconds([work])
            points.append((1 / t, b / t, f"EP{ep}"))
    return points
