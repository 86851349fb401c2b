"""The SimPy cluster: the engine's own scheduler and KV cache manager, a cost model for the forward
pass, routers, tiers and prefill-to-decode handoff."""

import pytest

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.scheduler import Scheduler
from deepinfer.platform.chips import sku_facts
from deepinfer.router.config import RouterConfig
from deepinfer.sim.cluster import ClusterConfig, EngineKnobs, PoolConfig, Simulation
from deepinfer.sim.costs import CalibratedCost, RooflineCost
from deepinfer.sim.policies import TierRetention, retention_policy
from deepinfer.sim.report import summarise
from deepinfer.sim.tiers import Tier, TieredStore
from deepinfer.sim.workload import Arrival, LengthDist, Segment, TrafficClass, WorkloadSpec, arrivals

CPU = StepCostModel(2e-3, 1e-4, 3e-5, 1e-8, 1e-6, "test")


def code(rate: float = 4.0, turns: float = 3.0) -> WorkloadSpec:
    return WorkloadSpec(
        classes=[
            TrafficClass(
                name="code", rate_per_s=rate, system_prompts=4, system_prompt_tokens=LengthDist(kind="uniform", low=100, high=400),
                turns_per_session=turns, revisit_gap_s=LengthDist(kind="exponential", mean=5),
                input_tokens=LengthDist(kind="uniform", low=64, high=512), output_tokens=LengthDist(mean=32),
            )
        ]
    )  # fmt: skip


def aggregated(budget_s: float | None = 0.05, blocks: int = 4000) -> Simulation:
    knobs = EngineKnobs(
        num_blocks=blocks, block_size=16, max_num_batched_tokens=2048, step_time_budget_s=budget_s
    )
    return Simulation(ClusterConfig([PoolConfig("both", 1, 1, CalibratedCost(CPU), knobs)]))


def test_every_request_gets_its_tokens_from_the_engines_scheduler() -> None:
    sim = aggregated()
    trace = list(arrivals(code(), 40, seed=0))
    sim.run(trace, until=200)
    rank = sim.pools["both"][0].ranks[0]
    assert isinstance(rank.scheduler, Scheduler)
    assert all(len(t.token_times) == t.arrival.output_tokens for t in sim.traces.values())
    assert all(t.first_token_s >= t.arrival.time for t in sim.traces.values())
    assert rank.kv.num_free_blocks == rank.kv.pool.num_blocks  # everything freed
    result = summarise(sim, 5, 40, 1)
    assert result["requests_finished"] == result["requests_arrived"] > 50
    assert 0.3 < result["cache_hit_rate"]["device"] < 0.95  # system prompts and histories hit


def test_the_time_budget_cuts_prompt_chunks() -> None:
    long_prompt = Arrival(0.0, "long", "code", (Segment(("p",), 1500),), 4)
    chunks = {}
    for budget in (None, 0.01):
        sim = aggregated(budget)
        sim.run([long_prompt], until=100)
        chunks[budget] = sim.pools["both"][0].steps
    assert chunks[0.01] > chunks[None]  # more, smaller prompt chunks under a 10 ms budget


def test_a_small_device_cache_evicts_and_hits_less() -> None:
    rates = []
    for blocks in (4000, 200):
        sim = aggregated(blocks=blocks)
        sim.run(arrivals(code(), 40, seed=2), until=200)
        rates.append(summarise(sim, 0, 40, 1)["cache_hit_rate"]["device"])
    assert rates[1] < rates[0]


def test_prefill_decode_handoff_with_tiers_and_ep() -> None:
    chip = sku_facts("gb200")
    prefill, decode = RooflineCost(chip, ep=8), RooflineCost(chip, ep=64)
    policy = retention_policy(code().ttls)
    store = TieredStore(
        [Tier("host", TierRetention(policy, 1e12), 50e9), Tier("store", TierRetention(policy, 1e15), 20e9)],
        70272,
    )
    config = ClusterConfig(
        [
            PoolConfig("prefill", 1, 2, prefill, EngineKnobs(num_blocks=20000, step_time_budget_s=0.2)),
            PoolConfig("decode", 1, 2, decode, EngineKnobs(num_blocks=20000, max_num_batched_tokens=512)),
        ],
        store=store,
    )
    sim = Simulation(config)
    sim.run(arrivals(code(rate=20), 30, seed=1), until=60)
    result = summarise(sim, 5, 30, 4)
    assert result["requests_finished"] == result["requests_arrived"] > 300
    assert all(len(t.token_times) == t.arrival.output_tokens for t in sim.traces.values() if t.finished_s)
    hits = result["cache_hit_rate"]
    assert (
        hits["device"] > 0 and hits["host"] > 0
    )  # histories evicted from the prefill device come back from host
    assert 0 < result["balance"]["decode"] <= 1 and result["occupancy_bytes"]
    decode_ranks = [r for w in sim.pools["decode"] for r in w.ranks]
    assert all(r.tokens_done > 0 for r in decode_ranks)  # the decode router spreads the load


def test_bad_cluster_configs() -> None:
    knobs = EngineKnobs(num_blocks=10)
    with pytest.raises(ValueError, match="one 'prefill' and one 'decode'"):
        ClusterConfig([PoolConfig("prefill", 1, 1, CalibratedCost(CPU), knobs)])
    with pytest.raises(ValueError, match="workers >= 1"):
        PoolConfig("both", 0, 1, CalibratedCost(CPU), knobs)
    with pytest.raises(ValueError, match="window is empty"):
        summarise(aggregated(), 10, 5, 1)


def test_the_routers_own_policies_route_in_the_simulator() -> None:
    # P/D: the router's plan sends a prompt under min_disaggregated_tokens straight to a decode rank
    # and a longer one through a prefill rank (two hops, the decode rank chosen at arrival).
    cost = CalibratedCost(CPU)
    knobs = EngineKnobs(num_blocks=4000, block_size=16, max_num_batched_tokens=2048)
    config = ClusterConfig(
        [PoolConfig("prefill", 1, 2, cost, knobs), PoolConfig("decode", 1, 2, cost, knobs)],
        router=RouterConfig(min_disaggregated_tokens=512),
    )
    sim = Simulation(config)
    short = Arrival(0.0, "short", "code", (Segment(("s",), 100),), 8)
    long = Arrival(0.0, "long", "code", (Segment(("l",), 1000),), 8)
    sim.run([short, long], until=100)
    assert sim.router.routes == {"short": 1, "long": 0, "two_hop": 1}
    assert all(len(t.token_times) == 8 for t in sim.traces.values())
    prefill_ranks = [r for w in sim.pools["prefill"] for r in w.ranks]
    assert sum(r.tokens_done for r in prefill_ranks) == 1000  # only the long prompt was prefilled there
    assert sim.env.now < 100  # stopped once every request finished
    # Aggregated: a burst that arrives between two load polls still spreads over the ranks, because
    # the router's LoadBook counts its own dispatches since the last report.
    sim = Simulation(
        ClusterConfig([PoolConfig("both", 1, 4, cost, knobs)], router=RouterConfig(poll_interval_s=10.0))
    )
    burst = [Arrival(0.001 * i, f"r{i}", "code", (Segment(("b", i), 800),), 4) for i in range(8)]
    sim.run(burst, until=100)
    assert [r.tokens_done > 0 for w in sim.pools["both"] for r in w.ranks] == [True] * 4


def _pd(queue_limit: int) -> Simulation:
    """One prefill and one decode worker behind a router whose prefill queue holds ``queue_limit``
    prompts (0: placed at arrival); every prompt takes two hops."""
    knobs = EngineKnobs(num_blocks=4000, block_size=16, max_num_batched_tokens=4096)
    slow = StepCostModel(1e-3, 0.0, 1e-3, 0.0, 0.0, "test")  # one second per 1000 prompt tokens
    pools = [PoolConfig(role, 1, 1, CalibratedCost(slow), knobs) for role in ("prefill", "decode")]
    router = RouterConfig(min_disaggregated_tokens=0, prefill_queue_limit=queue_limit)
    return Simulation(ClusterConfig(pools, router=router))


def test_the_routers_prefill_queue_binds_long_prompts_late_and_longest_first() -> None:
    """With late binding (the router's default), a prompt waits in the router while the prefill
    worker's backlog is over the horizon, and of the waiting ones the longest (by more than it
    arrived later) goes first; placed at arrival, the engine takes them in arrival order."""
    trace = [
        Arrival(0.001 * i, f"r{i}", "code", (Segment((f"p{i}",), n),), 4)
        for i, n in enumerate((600, 1000, 2000))
    ]
    order = {}
    for limit in (0, 16):
        sim = _pd(limit)
        sim.run(trace, until=100)
        assert all(len(t.token_times) == 4 for t in sim.traces.values())
        order[limit] = sorted(sim.traces, key=lambda rid: sim.traces[rid].first_token_s)
    assert order[0] == ["r0", "r1", "r2"]
    assert order[16] == ["r0", "r2", "r1"]


def test_a_full_prefill_queue_rejects_as_the_router_does() -> None:
    trace = [Arrival(0.001 * i, f"r{i}", "code", (Segment((f"p{i}",), 1000),), 2) for i in range(4)]
    sim = _pd(1)
    sim.run(trace, until=100)
    # r0 is placed at once, r1 waits in the queue, r2 and r3 find it full (the router's 429).
    assert [sim.traces[f"r{i}"].rejected for i in range(4)] == [False, False, True, True]
    assert summarise(sim, 0, 1, 1)["requests_rejected"] == 2


def test_pools_sharing_a_host_slow_each_other_down() -> None:
    """host_contention: a decode step that starts while the prefill worker is in a step takes longer;
    with separate hosts (0, the default) the same trace decodes faster."""
    trace = [Arrival(0.01 * i, f"r{i}", "code", (Segment((f"p{i}",), 800),), 16) for i in range(6)]
    tpot = {}
    for contention in (0.0, 1.0):
        knobs = EngineKnobs(num_blocks=4000, block_size=16, max_num_batched_tokens=4096)
        pools = [PoolConfig(role, 1, 1, CalibratedCost(CPU), knobs, host_contention=contention)
                 for role in ("prefill", "decode")]  # fmt: skip
        sim = Simulation(ClusterConfig(pools, router=RouterConfig(min_disaggregated_tokens=0)))
        sim.run(trace, until=100)
        tpot[contention] = summarise(sim, 0, 1, 1)["tpot_s"]["mean"]
    assert tpot[1.0] > 1.05 * tpot[0.0]
    with pytest.raises(ValueError, match="host_contention must be >= 0"):
        PoolConfig("decode", 1, 1, CalibratedCost(CPU), knobs, host_contention=-0.1)
