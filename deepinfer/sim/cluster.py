"""The discrete-event cluster simulation (SimPy): arrivals, routers, workers running the engine's own
scheduler, the KV tiers, and prefill-to-decode handoff.

A *pool* is a set of workers of one role (``prefill``, ``decode`` or ``both``). A worker is one
expert-parallel group stepping in lockstep; each of its simulated *ranks* (data-parallel attention
ranks) owns a real :class:`~deepinfer.engine.scheduler.Scheduler` with a real
:class:`~deepinfer.engine.kv_cache_manager.KVCacheManager` (the device cache tier, prefix caching
included) and cuts prompt chunks with the engine's time budget. Only the forward pass is replaced:
a step lasts what the pool's :class:`~deepinfer.sim.costs.ForwardCost` says, then each sampling
request receives its next (predetermined) output token and the scheduler applies it as the engine
does.

A request is routed by the serving router's own code (:mod:`deepinfer.sim.routing`: its policies and
load bookkeeping, fed by simulated load polls): with a ``prefill`` and a ``decode`` pool a prompt of
at least ``min_disaggregated_tokens`` goes to a prefill rank and, chosen at the same time, a decode
rank (two hops), after waiting in the router's prefill queue (late binding) as long as the router
would have it wait; a shorter one goes straight to a decode rank, which computes it too. Its prompt's leading blocks found in the rank's device cache count as device hits, the next
ones held by a lower tier (host, store) are loaded (taking the tier's read time) into free device
blocks, and the rest is computed. A prefill worker computes the prompt and samples the first token;
the KV then moves to the decode rank the router chose (``kv_transfer_bytes_per_s``), lands there as cached blocks, and the decode rank generates the rest. Finished requests write their
KV through to the lower tiers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import simpy

from deepinfer.core.roles import Role
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.router.config import RouterConfig
from deepinfer.router.policies import TwoHop
from deepinfer.router.prefill_queue import QueueFull
from deepinfer.sampling_params import SamplingParams
from deepinfer.sim.costs import ForwardCost
from deepinfer.sim.routing import SimRouter
from deepinfer.sim.tiers import TieredStore
from deepinfer.sim.workload import Arrival

PoolRole = Literal["prefill", "decode", "both"]
_PARAMS = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)  # shared, read-only


@dataclass(frozen=True, slots=True)
class EngineKnobs:
    """The engine settings of every rank in a pool (EngineConfig's scheduling fields)."""

    num_blocks: int
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int | None = None
    step_time_budget_s: float | None = None
    max_model_len: int = 131072
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class PoolConfig:
    role: PoolRole
    workers: int  # simulated EP groups
    ranks_per_worker: int  # simulated DP ranks of each group
    cost: ForwardCost
    knobs: EngineKnobs
    # A step that starts while a worker of another pool is in a step takes (1 + this) times its cost:
    # pools sharing one host's cores and memory (the validation's P/D workers on one machine). 0:
    # each worker has its own chips, as in a deployment.
    host_contention: float = 0.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.ranks_per_worker < 1:
            raise ValueError(f"a {self.role} pool needs workers >= 1 and ranks_per_worker >= 1")
        if self.host_contention < 0:
            raise ValueError(f"a {self.role} pool's host_contention must be >= 0, got {self.host_contention}")


@dataclass(slots=True)
class ClusterConfig:
    pools: list[PoolConfig]
    store: TieredStore | None = None
    kv_transfer_bytes_per_s: float = 50e9
    kv_bytes_per_token: float = 70272.0
    admission_delay_s: float = 0.0  # arrival -> scheduler: the API front (HTTP, validation, hand-off)
    delivery_delay_s: float = 0.0  # a token's step end -> the client has it (detokenizer, SSE, HTTP)
    # The P/D handoff. "prefill": the prefill worker's first token is the client's, the decode worker
    # continues after it with the whole prompt's KV (DeepSeek's design). "decode": our router's
    # (deepinfer.router.proxy): the prefill hop's token is not streamed; the decode worker gets the
    # prompt's full blocks before its last token, computes the rest and samples the first token.
    first_token_from: Literal["prefill", "decode"] = "prefill"
    kv_transfer_latency_s: float = 0.0  # per handoff, on top of the bytes (router hop, file writes)
    router: RouterConfig = field(default_factory=RouterConfig)  # policies, thresholds, poll period

    def __post_init__(self) -> None:
        roles = sorted(p.role for p in self.pools)
        if roles not in (["both"], ["decode", "prefill"]):
            raise ValueError(
                f"pools must be one 'both' pool, or one 'prefill' and one 'decode' pool; got {roles}"
            )


@dataclass(slots=True)
class RequestTrace:
    """What one request saw: times are simulated seconds."""

    arrival: Arrival
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_s: float | None = None
    hit_tokens: dict[str, int] = field(default_factory=dict)  # tier -> prompt tokens not recomputed
    rejected: bool = False  # the router's prefill queue was full (the router answers 429)


class _Rank:
    """One simulated engine: the engine's scheduler and KV cache manager, and what the router reads
    (:class:`~deepinfer.sim.routing.RoutableRank`)."""

    def __init__(self, index: int, role: Role, knobs: EngineKnobs, cost: ForwardCost) -> None:
        self.index = index
        self.role = role
        self.url = f"sim://{role.value}/{index}"
        self.kv = KVCacheManager(knobs.num_blocks, knobs.block_size, knobs.enable_prefix_caching)
        budget = knobs.max_num_batched_tokens
        self.cost_model = cost.scheduler_model() if knobs.step_time_budget_s is not None else None
        self.predictor = self.cost_model or cost.scheduler_model()
        self.in_flight = 0
        self.busy_s = 0.0
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=knobs.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=knobs.max_model_len,
                long_prefill_token_threshold=knobs.long_prefill_token_threshold or budget,
                step_time_budget_s=knobs.step_time_budget_s,
            ),
            self.kv,
            self.cost_model,
        )
        self.tokens_done = 0

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.kv


class _Worker:
    def __init__(self, env: simpy.Environment, pool: PoolConfig, first_rank: int, sim: Simulation) -> None:
        self.env, self.pool, self.sim = env, pool, sim
        role = Role(pool.role)
        self.ranks = [
            _Rank(first_rank + i, role, pool.knobs, pool.cost) for i in range(pool.ranks_per_worker)
        ]
        self.wake: simpy.Event | None = None
        self.stepping = False
        self.steps = 0
        self.busy_s = 0.0
        self.balance_sum = 0.0
        env.process(self.run())

    def notify(self) -> None:
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def run(self):
        while True:
            outputs = [rank.scheduler.schedule() for rank in self.ranks]
            if all(o.is_empty for o in outputs):
                self.wake = self.env.event()
                yield self.wake
                self.wake = None
                continue
            work = [[(r.num_new_tokens, r.num_computed_tokens) for r in o.requests] for o in outputs]
            scale = (
                1 + self.pool.host_contention
                if self.pool.host_contention and self.sim.stepping_besides(self)
                else 1
            )
            seconds = self.pool.cost.step_seconds(work) * scale
            self.stepping = True
            yield self.env.timeout(seconds)
            self.stepping = False
            self.steps += 1
            self.busy_s += seconds
            tokens = [sum(n for n, _ in w) for w in work]
            self.balance_sum += (sum(tokens) / len(tokens)) / max(tokens)
            runner_s = self.pool.cost.runner_seconds(work) * scale
            for rank, output in zip(self.ranks, outputs):
                rank.busy_s += seconds
                rank.scheduler.observe_step_time(output, runner_s)
                self.sim.apply(self, rank, output)


class Simulation:
    """One run: build with a config, feed arrivals with :meth:`run`, read the traces."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.env = simpy.Environment()
        self.traces: dict[str, RequestTrace] = {}
        self._requests: dict[str, tuple[Arrival, list[int]]] = {}  # id -> arrival, output token ids
        self._offsets: dict[str, int] = {}  # id -> output tokens emitted by an earlier worker
        self.pools: dict[str, list[_Worker]] = {}
        first = 0
        for pool in config.pools:
            workers = []
            for _ in range(pool.workers):
                workers.append(_Worker(self.env, pool, first, self))
                first += pool.ranks_per_worker
            self.pools[pool.role] = workers
        self.occupancy: list[tuple[float, dict[str, float]]] = []
        ranks = [r for workers in self.pools.values() for w in workers for r in w.ranks]
        self._by_url = {r.url: (w, r) for workers in self.pools.values() for w in workers for r in w.ranks}
        self.router = SimRouter(config.router, ranks)
        self._decode_url: dict[str, str] = {}  # two-hop request id -> the decode rank chosen for it
        self._open = 0  # requests admitted and not finished
        self._arriving = True
        self._drained = self.env.event()

    def stepping_besides(self, worker: _Worker) -> bool:
        """Whether a worker of another pool than ``worker``'s is in a step now."""
        return any(w.stepping for role, ws in self.pools.items() if role != worker.pool.role for w in ws)

    # ------------------------------------------------------------------ driving
    def run(self, arrivals: Iterable[Arrival], until: float, sample_every_s: float = 60.0) -> None:
        """Feed ``arrivals`` (in time order) and run to ``until`` or until every request that arrived
        before it has finished, whichever is first."""
        self._arriving = True
        self._drained = self.env.event()
        self.env.process(self._arrive(iter(arrivals), until))
        self.env.process(self._poll())
        if self.config.store is not None:
            self.env.process(self._sample_occupancy(sample_every_s))
        self.env.run(until=self.env.any_of([self.env.timeout(until - self.env.now), self._drained]))

    def _arrive(self, arrivals, until: float):
        for arrival in arrivals:
            if arrival.time >= until:
                break
            yield self.env.timeout(max(0.0, arrival.time - self.env.now))
            self._open += 1
            self.env.process(self._admit(arrival))
        self._arriving = False
        self._check_drained()

    def _check_drained(self) -> None:
        if not self._arriving and not self._open and not self._drained.triggered:
            self._drained.succeed()

    def _poll(self):
        """The router's load polls (``RouterConfig.poll_interval_s``)."""
        while not self._drained.triggered:
            self.router.poll(self.env.now)
            yield self.env.timeout(self.config.router.poll_interval_s)

    def _sample_occupancy(self, every_s: float):
        while not self._drained.triggered:
            self.occupancy.append((self.env.now, self.config.store.occupancy(self.env.now)))
            yield self.env.timeout(every_s)

    def _admit(self, arrival: Arrival):
        trace = RequestTrace(arrival)
        self.traces[arrival.request_id] = trace
        if self.config.admission_delay_s > 0:
            yield self.env.timeout(self.config.admission_delay_s)
        prompt = arrival.token_ids()
        outputs = arrival.output_token_ids()
        self._requests[arrival.request_id] = (arrival, outputs)
        if self.router.late(len(prompt)):
            try:
                route = yield from self.router.place(
                    self.env, arrival.request_id, len(prompt), arrival.output_tokens
                )
            except QueueFull:  # the router answers 429: the request is never served
                trace.rejected = True
                self._open -= 1
                self._check_drained()
                return
        else:
            route = self.router.route(arrival.request_id, len(prompt), arrival.output_tokens, self.env.now)
        if isinstance(route, TwoHop):
            self._decode_url[arrival.request_id] = route.decode.url
            worker, rank = self._by_url[route.prefill.url]
        else:
            worker, rank = self._by_url[route.worker.url]
        rank.in_flight += 1
        max_tokens = 1 if rank.role is Role.PREFILL else arrival.output_tokens
        request = Request(arrival.request_id, prompt, _PARAMS, 0, max_tokens, frozenset(), self.env.now)
        device = len(rank.kv.find_cached_prefix(request)) * rank.kv.block_size
        trace.hit_tokens["device"] = device
        store = self.config.store
        if store is not None:
            hit = store.lookup(arrival, device, self.env.now)
            trace.hit_tokens.update(hit.tokens)
            if hit.load_s > 0:
                yield self.env.timeout(hit.load_s)
            _land(rank.kv, request, device + sum(hit.tokens.values()))
        rank.scheduler.add_request(request)
        worker.notify()

    def apply(self, worker: _Worker, rank: _Rank, output) -> None:
        """A step's results on one rank: the next output token of every sampling request."""
        sampled = {}
        for scheduled in output.requests:
            rank.tokens_done += scheduled.num_new_tokens
            if scheduled.samples:
                request = rank.scheduler.requests[scheduled.request_id]
                _, outputs = self._requests[scheduled.request_id]
                index = self._offsets.get(scheduled.request_id, 0) + request.num_output_tokens
                sampled[scheduled.request_id] = [outputs[index]]
        now = self.env.now
        delivered = now + self.config.delivery_delay_s
        hidden = rank.role is Role.PREFILL and self.config.first_token_from == "decode"
        for request in rank.scheduler.update_from_output(output, sampled):
            trace = self.traces[request.request_id]
            if not hidden:
                trace.token_times.append(delivered)
                if trace.first_token_s is None:
                    trace.first_token_s = delivered
            if request.num_output_tokens == 1:
                self.router.first_output(rank.url, request.request_id, now)
            if request.status.finished:
                self._finished(rank, request, trace)

    def _finished(self, rank: _Rank, request: Request, trace: RequestTrace) -> None:
        rid, now = request.request_id, self.env.now
        arrival, _ = self._requests[rid]
        rank.in_flight -= 1
        self.router.finished(rank.url, rid, now)
        decode_url = self._decode_url.pop(rid, None)
        if decode_url is not None and (arrival.output_tokens > 1 or self.config.first_token_from == "decode"):
            self.env.process(self._handoff(arrival, request, decode_url))
            return
        if decode_url is not None:  # one output token: the decode hop has nothing to do
            self.router.finished(decode_url, rid, now)
        trace.finished_s = now + self.config.delivery_delay_s
        del self._requests[rid]
        self._offsets.pop(rid, None)
        if self.config.store is not None:
            self.config.store.write(arrival, now)
        self._open -= 1
        self._check_drained()

    def _handoff(self, arrival: Arrival, prefilled: Request, decode_url: str):
        """Prefill done: move the prompt's KV to the decode rank chosen for it and continue there."""
        config = self.config
        worker, rank = self._by_url[decode_url]
        if config.first_token_from == "decode":  # the decode worker recomputes the prompt's tail
            tokens = list(prefilled.prompt_token_ids)
            handed = (len(tokens) - 1) // rank.kv.block_size * rank.kv.block_size
            max_tokens = arrival.output_tokens
        else:
            tokens = list(prefilled.all_token_ids)
            handed = prefilled.num_computed_tokens
            max_tokens = arrival.output_tokens - 1
            self._offsets[arrival.request_id] = 1  # the prefill worker sampled the first output token
        nbytes = handed * config.kv_bytes_per_token
        yield self.env.timeout(config.kv_transfer_latency_s + nbytes / config.kv_transfer_bytes_per_s)
        rank.in_flight += 1
        request = Request(arrival.request_id, tokens, _PARAMS, 0, max_tokens, frozenset(), self.env.now)
        request.block_hashes.extend(prefilled.block_hashes[: len(tokens) // rank.kv.block_size])  # same chain
        rank.kv.find_cached_prefix(request)  # hashes the rest
        _land(rank.kv, request, handed)
        rank.scheduler.add_request(request)
        worker.notify()


def _land(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Put the request's first ``num_tokens`` tokens' KV into the device cache as cached (free,
    hashed) blocks, as a KV connector's load would, so the scheduler's prefix lookup finds them.
    Blocks already cached are kept; when the pool has no free block left the rest is recomputed.
    The request's block hashes must be computed (``kv.find_cached_prefix`` does it)."""
    if not kv.pool.enable_prefix_caching:
        return
    held = []  # referenced while landing, so that allocating one block cannot evict another
    for block_hash in request.block_hashes[: min(num_tokens, request.num_tokens - 1) // kv.block_size]:
        block = kv.pool.lookup(block_hash)
        if block is not None:
            kv.pool.take([block])
        elif kv.pool.num_free_blocks == 0:
            break
        else:
            block = kv.pool.allocate(1)[0]
            kv.pool.register(block, block_hash)
        held.append(block)
    kv.pool.release(list(reversed(held)))
