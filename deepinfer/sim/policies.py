"""The policies the simulator drives, behind the interfaces the serving system's own code implements.

Four seams, each a small protocol, each with the implementation the simulator uses today:

- :class:`RetentionPolicy` — which KV entries a cache tier keeps (TTL by traffic class, capacity
  eviction), clock injected. Stand-in: :class:`TtlLruRetention` (TTL refreshed on use, least recently
  used evicted past capacity). The KV store's own pure retention module replaces it.
- :class:`Router` — which rank of a pool gets a request, from a load snapshot. Stand-ins:
  :class:`PredictedTimeRouter` (prefill: least predicted queue time from the rank's cost model,
  cache-agnostic as DeepSeek's is) and :class:`ActiveLoadRouter` (decode: active requests and KV
  tokens). The P/D router module replaces them.
- :data:`ExpertPlacer` — DeepSeek's EPLB signature ``rebalance_experts(weight, num_replicas,
  num_groups, num_nodes, num_gpus) -> (phy2log, log2phy, logcnt)``. Stand-in:
  :func:`identity_placement` (no redundant experts, logical expert i on GPU i // (E / gpus): what a
  deployment without EPLB gets). The parallel package's ``rebalance_experts`` drops in unchanged.

The scheduler and time-budget chunking are not stand-ins: the simulator runs the engine's own.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


# --------------------------------------------------------------------------- retention
class RetentionPolicy(Protocol):
    capacity_bytes: float

    def touch(self, key: Hashable, nbytes: float, ttl_s: float, now: float) -> None:
        """Write ``key`` (or refresh it, when present) at time ``now``, kept ``ttl_s`` from now."""

    def contains(self, key: Hashable, now: float) -> bool:
        """Whether ``key`` is held (and unexpired) at ``now``; counts as a use for eviction order."""

    def used_bytes(self, now: float) -> float:
        """Bytes held at ``now`` (expired entries dropped)."""


class TtlLruRetention:
    """TTL per entry (refreshed on every use) and least-recently-used eviction past capacity."""

    def __init__(self, capacity_bytes: float) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (bytes, expiry)
        self._expiries: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self._used = 0.0
        self.evicted_bytes = 0.0
        self.expired_bytes = 0.0

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expiry, _, key = heapq.heappop(self._expiries)
            entry = self._entries.get(key)
            if entry is not None and entry[1] == expiry:
                del self._entries[key]
                self._used -= entry[0]
                self.expired_bytes += entry[0]

    def touch(self, key: Hashable, nbytes: float, ttl_s: float, now: float) -> None:
        self._expire(now)
        if nbytes > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= old[0]
        expiry = now + ttl_s
        self._entries[key] = (nbytes, expiry)
        self._used += nbytes
        self._seq += 1
        heapq.heappush(self._expiries, (expiry, self._seq, key))
        while self._used > self.capacity_bytes:
            _, (size, _) = self._entries.popitem(last=False)
            self._used -= size
            self.evicted_bytes += size

    def contains(self, key: Hashable, now: float) -> bool:
        self._expire(now)
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def used_bytes(self, now: float) -> float:
        self._expire(now)
        return self._used


# --------------------------------------------------------------------------- routing
@dataclass(frozen=True, slots=True)
class RankLoad:
    """A router's view of one rank: queued prompt work, running requests, KV tokens held."""

    rank: int
    predicted_queue_s: float  # the rank's cost model over its waiting and unfinished prompt work
    active_requests: int
    kv_tokens: int


class Router(Protocol):
    def pick(self, prompt_tokens: int, loads: Sequence[RankLoad]) -> int:
        """The rank (``RankLoad.rank``) that gets a request of ``prompt_tokens`` tokens."""


class PredictedTimeRouter:
    """Prefill: the rank whose queue the cost model predicts to drain first; ties to the lowest id."""

    def pick(self, prompt_tokens: int, loads: Sequence[RankLoad]) -> int:
        return min(loads, key=lambda r: (r.predicted_queue_s, r.rank)).rank


class ActiveLoadRouter:
    """Decode: fewest active requests plus KV tokens in units of ``tokens_per_request``."""

    def __init__(self, tokens_per_request: float = 4096.0) -> None:
        self.tokens_per_request = tokens_per_request

    def pick(self, prompt_tokens: int, loads: Sequence[RankLoad]) -> int:
        return min(
            loads, key=lambda r: (r.active_requests + r.kv_tokens / self.tokens_per_request, r.rank)
        ).rank


# --------------------------------------------------------------------------- expert placement
ExpertPlacer = Callable[
    ..., tuple
]  # rebalance_experts(weight[L, E], num_replicas, num_groups, num_nodes, num_gpus)


def identity_placement(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """No EPLB: physical expert p is logical expert p (no redundancy). Same signature and outputs as
    DeepSeek's ``rebalance_experts``: ``phy2log[L, P]``, ``log2phy[L, E, 1]``, ``logcnt[L, E]``."""
    import torch

    layers, experts = weight.shape
    if num_replicas != experts:
        raise ValueError(
            f"identity placement has no redundant experts: num_replicas must be {experts}, got "
            f"{num_replicas} (plug in an EPLB placer for redundancy)"
        )
    phy2log = torch.arange(experts).repeat(layers, 1)
    return phy2log, phy2log.unsqueeze(-1).clone(), torch.ones(layers, experts, dtype=torch.long)


def synthetic_expert_load(layers: int, experts: int, sigma: float, seed: int = 0) -> np.ndarray:
    """Tokens per logical expert per layer: a seeded lognormal popularity (``sigma`` 0 = uniform)."""
    rng = np.random.default_rng(seed)
    return rng.lognormal(0.0, sigma, size=(layers, experts)) if sigma > 0 else np.ones((layers, experts))


def expert_imbalance(
    placer: ExpertPlacer, load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> float:
    """max/mean routed tokens per GPU, averaged over layers, for the placement ``placer`` chooses for
    ``load`` (a logical expert's tokens split evenly over its replicas)."""
    import torch

    layers = load.shape[0]
    weight = torch.as_tensor(load, dtype=torch.float64)
    phy2log, _, logcnt = placer(weight, num_replicas, num_groups, num_nodes, num_gpus)
    per_replica = torch.gather(weight / logcnt.to(weight.dtype), 1, phy2log)  # [L, P]
    per_gpu = per_replica.reshape(layers, num_gpus, -1).sum(-1)
    return float((per_gpu.max(-1).values / per_gpu.mean(-1)).mean())
