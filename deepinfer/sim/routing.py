"""The router inside the simulator: the serving router's own decision path on the simulated clock.

Nothing here decides anything: :func:`deepinfer.router.policies.plan` picks the path (straight to one
worker, or prefill then decode) and the worker by the configured policies (estimated-compute for
prompts, decode-load for decodes); :class:`deepinfer.router.loadbook.LoadBook` keeps the load views,
merging each worker's last report (polled every ``poll_interval_s``, as the router polls ``GET
/load``) with the router's own dispatches since; :func:`deepinfer.router.load.engine_load` reads a
simulated rank's scheduler exactly as the server reads its engine. The settings are the router's
(:class:`~deepinfer.router.config.RouterConfig`). What this module adds is the wiring: one worker URL
per simulated rank, and the calls the proxy makes (dispatched, first output, finished).
"""

from __future__ import annotations

from typing import Protocol

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.router.config import RouterConfig
from deepinfer.router.load import CostModel, WorkerLoad, engine_load
from deepinfer.router.loadbook import LoadBook
from deepinfer.router.policies import DecodeLoad, Direct, RequestInfo, TwoHop, plan, prefill_policy
from deepinfer.router.roles import Role

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

    def route(self, request_id: str, prompt_tokens: int, max_tokens: int, now: float) -> Direct | TwoHop:
        """Where a new request goes; records the dispatch(es) as the proxy does."""
        info = RequestInfo(prompt_tokens, max_tokens)
        route = plan(info, self.book.views(), self.prefill, self.decode, self.config.min_disaggregated_tokens)
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

    def finished(self, url: str, request_id: str, now: float) -> None:
        self.book.finished(url, request_id, now)
