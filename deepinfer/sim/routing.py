"""The router inside the simulator: the serving router's own decision path on the simulated clock.

Nothing here decides anything: :func:`deepinfer.router.policies.plan` picks the path (straight to one
worker, or prefill then decode) and the worker by the configured policies (estimated-compute for
prompts, decode-load for decodes); :class:`deepinfer.router.loadbook.LoadBook` keeps the load views,
merging each worker's last report (polled every ``poll_interval_s``, as the router polls ``GET
/load``) with the router's own dispatches since; :func:`deepinfer.core.load.engine_load` reads a
simulated rank's scheduler exactly as the server reads its engine. The settings are the router's
(:class:`~deepinfer.router.config.RouterConfig`). What this module adds is the wiring: one worker URL
per simulated rank, and the calls the proxy makes (dispatched, first output, finished).

Late binding, as the router's app sets it up (estimated-compute with a queue limit): a long prompt
waits in the router until the prefill worker the policy picks has an expected backlog under
``prefill_horizon_s`` (:mod:`deepinfer.router.prefill_queue`). :class:`SimPrefillQueue` is that queue on
the simulated clock: the router's :class:`~deepinfer.router.prefill_queue.PrefillQueue` decides (its
horizon, limit, order key and recheck period); only its asyncio wait becomes a SimPy one.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Generator
from typing import Protocol

import simpy

from deepinfer.core.load import CostModel, WorkerLoad, engine_load
from deepinfer.core.roles import Role
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.router.config import RouterConfig
from deepinfer.router.loadbook import LoadBook
from deepinfer.router.policies import DecodeLoad, Direct, RequestInfo, TwoHop, plan, prefill_policy
from deepinfer.router.prefill_queue import PrefillQueue, QueueFull

SHARED_STORE = "sim"  # every simulated rank hands KV through one shared store (DeepSeek's 3FS)


class RoutableRank(Protocol):
    """What the router needs of a simulated rank: the engine parts ``engine_load`` reads."""

    url: str
    role: Role
    scheduler: Scheduler
    kv_cache: KVCacheManager
    predictor: StepCostModel  # the cost model the worker reports
    in_flight: int  # requests routed to it and not finished (the server's admitted count)
    busy_s: float


class SimRouter:
    """One router in front of every simulated rank (see the module docstring)."""

    def __init__(self, config: RouterConfig, ranks: list[RoutableRank]) -> None:
        self.config = config
        self.prefill = prefill_policy(config.prefill_policy)
        self.decode = DecodeLoad(config.decode_request_weight_tokens)
        self.book = LoadBook()
        self.ranks = {r.url: r for r in ranks}
        self.routes = {"short": 0, "long": 0, "two_hop": 0}
        self.queue: SimPrefillQueue | None = None
        if config.prefill_policy == "estimated-compute" and config.prefill_queue_limit:
            queue = PrefillQueue(config.prefill_horizon_s, config.prefill_queue_limit, config.poll_interval_s)
            self.queue = SimPrefillQueue(queue)

    def late(self, prompt_tokens: int) -> bool:
        """Whether a prompt this long goes through the prefill queue (as the proxy decides)."""
        return self.queue is not None and prompt_tokens >= self.config.min_disaggregated_tokens

    def poll(self, now: float) -> None:
        """Every rank's ``GET /load`` report, as of ``now``."""
        for url, rank in self.ranks.items():
            report = WorkerLoad(
                model="sim",
                model_fingerprint="sim",
                kv_layout="sim",
                role=rank.role,
                healthy=True,
                num_in_flight=rank.in_flight,
                engine=engine_load(rank, rank.busy_s),
                cost_model=CostModel.of(rank.predictor),
                kv_store_id=SHARED_STORE,
            )
            self.book.observe(url, report, now)
        self._progress()

    def route(self, request_id: str, prompt_tokens: int, max_tokens: int, now: float) -> Direct | TwoHop:
        """Where a new request goes; records the dispatch(es) as the proxy does."""
        info = RequestInfo(prompt_tokens, max_tokens)
        return self._book(request_id, info, self._plan(info), now)

    def place(
        self, env: simpy.Environment, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Generator[simpy.Event, None, Direct | TwoHop]:
        """A SimPy process step (``yield from``): wait in the prefill queue for a worker under the
        horizon (see the module docstring), then book the route as :meth:`route` does. Raises
        :class:`~deepinfer.router.prefill_queue.QueueFull` as the router's queue does (it answers 429)."""
        if self.queue is None:
            raise RuntimeError("place(): this router has no prefill queue (see late())")
        info = RequestInfo(prompt_tokens, max_tokens)
        under = self.queue.queue.under_horizon

        def attempt() -> Direct | TwoHop | None:
            route = self._plan(info)
            worker = route.prefill if isinstance(route, TwoHop) else route.worker
            if not under(worker.expected_backlog_s):
                return None
            return self._book(request_id, info, route, env.now)

        def cost_s() -> float:
            able = [v for v in self.book.views() if v.admitted and v.can_prefill]
            return min((v.slowdown * v.request_cost_s(info) for v in able), default=0.0)

        return (yield from self.queue.place(env, attempt, cost_s))

    def _plan(self, info: RequestInfo) -> Direct | TwoHop:
        return plan(info, self.book.views(), self.prefill, self.decode, self.config.min_disaggregated_tokens)

    def _book(
        self, request_id: str, info: RequestInfo, route: Direct | TwoHop, now: float
    ) -> Direct | TwoHop:
        prompt_tokens, max_tokens = info.prompt_tokens, info.max_tokens
        if isinstance(route, TwoHop):
            self.routes["two_hop"] += 1
            self.book.dispatched(
                route.prefill.url, request_id, route.prefill.request_cost_s(info), prompt_tokens, now
            )
            self.book.dispatched(route.decode.url, request_id, 0.0, prompt_tokens + max_tokens, now)
        else:
            self.routes[route.reason] += 1
            self.book.dispatched(
                route.worker.url, request_id, route.worker.request_cost_s(info), prompt_tokens, now
            )
        return route

    def first_output(self, url: str, request_id: str, now: float) -> None:
        self.book.prefilled(url, request_id, now)
        self._progress()

    def finished(self, url: str, request_id: str, now: float) -> None:
        self.book.finished(url, request_id, now)
        self._progress()

    def _progress(self) -> None:
        """A worker's load went down, or a report came in: waiting prompts may be placeable."""
        if self.queue is not None:
            self.queue.kick()


class SimPrefillQueue:
    """The router's prefill queue (``queue``: its settings and horizon test) waiting on the simulated
    clock; :meth:`place` mirrors :meth:`PrefillQueue.place <deepinfer.router.prefill_queue.PrefillQueue.place>`.
    Only the head tries a placement, so only the head is woken (the router wakes every waiter and
    the others go back to sleep: the same order, without the simulated cost of it)."""

    def __init__(self, queue: PrefillQueue) -> None:
        self.queue = queue
        # (arrival - expected prompt seconds, arrival order, the waiter's wake-up) in queue order
        self._entries: list[list] = []
        self._seq = itertools.count()

    @property
    def depth(self) -> int:
        return len(self._entries)

    def kick(self) -> None:
        """Something changed: the head looks again."""
        if self._entries and not (wake := self._entries[0][2]).triggered:
            wake.succeed()

    def place(
        self, env: simpy.Environment, attempt: Callable[[], object | None], cost_s: Callable[[], float]
    ):
        """Wait for this request's turn and a placement (``attempt()``, called only for the head).
        ``cost_s()``: the request's expected prompt seconds (its priority), asked only if it waits."""
        if not self._entries:
            placed = attempt()
            if placed is not None:
                return placed
        if len(self._entries) >= self.queue.limit:
            raise QueueFull(f"{self.queue.limit} requests are already waiting for a prefill worker")
        entry = [env.now - max(0.0, cost_s()), next(self._seq), env.event()]
        bisect.insort(self._entries, entry, key=lambda e: (e[0], e[1]))
        try:
            while True:
                if self._entries[0] is entry:
                    placed = attempt()
                    if placed is not None:
                        return placed
                    yield entry[2] | env.timeout(self.queue.recheck_s)
                else:
                    yield entry[2]  # woken once it is the head
                if entry[2].triggered:
                    entry[2] = env.event()
        finally:
            self._entries.remove(entry)
            self.kick()  # the next head may be placeable now
