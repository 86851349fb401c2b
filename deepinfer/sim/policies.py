"""The KV store's retention and the expert placement, as the simulator drives them.

- Retention: the KV store's own pure policy (:mod:`deepinfer.kvstore.retention`: per-traffic-class
  TTLs, watermark eviction of expired then least recently used entries), on the simulated clock;
  :class:`TierRetention` keeps one tier's entries, as the store's tiers do, and asks the policy.
- :data:`ExpertPlacer` — DeepSeek's EPLB signature ``rebalance_experts(weight, num_replicas,
  num_groups, num_nodes, num_gpus) -> (phy2log, log2phy, logcnt)``. Stand-in:
  :func:`identity_placement` (no redundant experts, logical expert i on GPU i // (E / gpus): what a
  deployment without EPLB gets). The parallel package's ``rebalance_experts`` drops in unchanged.

The scheduler and time-budget chunking are the engine's own (:mod:`deepinfer.sim.cluster`), and so
are the router's policies and load bookkeeping (:mod:`deepinfer.sim.routing`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import numpy as np

from deepinfer.kvstore.retention import (
    HIGH_WATERMARK,
    Entry,
    RetentionPolicy,
    expired,
    is_expired,
    plan_eviction,
)


# --------------------------------------------------------------------------- retention
def retention_policy(classes: Mapping[str, float]) -> RetentionPolicy:
    """The KV store's policy for a workload's traffic classes (name -> TTL seconds); the first class
    is the default, as a store configured with those classes would have it."""
    if not classes:
        raise ValueError("a retention policy needs at least one traffic class")
    return RetentionPolicy(dict(classes), next(iter(classes)))


class TierRetention:
    """One simulated tier's entries under the KV store's own retention policy
    (:mod:`deepinfer.kvstore.retention`: per-class TTL extended by saves and hits, never shortened;
    expired entries never served; past the high watermark, expired then least recently used entries
    evicted down to the low watermark; a save that still does not fit is refused).

    The bookkeeping a tier keeps (its entries, the bytes they use) is here, as the store's file and
    host tiers keep theirs; every decision is the policy module's. Keys are any hashable (the
    workload's segment keys), sizes in bytes."""

    def __init__(self, policy: RetentionPolicy, capacity_bytes: float) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.policy = policy
        self.capacity_bytes = capacity_bytes
        self._entries: dict[Hashable, Entry] = {}
        self._used = 0.0
        self.evicted_bytes = 0.0
        self.expired_bytes = 0.0
        self.refused_bytes = 0.0

    def contains(self, key: Hashable, cls: str, now: float) -> bool:
        """Whether ``key`` is held unexpired at ``now``; a hit by ``cls`` (last use now, expiry
        extended for the class)."""
        entry = self._entries.get(key)
        if entry is None or is_expired(entry, now):
            return False
        entry.last_used = now
        entry.expires_at = self.policy.expiry(entry.expires_at, now, cls)
        return True

    def save(self, key: Hashable, nbytes: float, cls: str, now: float) -> None:
        """Write ``key`` for ``cls`` at ``now`` (a held, unexpired key is only touched, as the
        store's write-once tiers do)."""
        if self.contains(key, cls, now):
            return
        stale = self._entries.get(key)
        if stale is not None:  # expired: collected, then written afresh
            self._remove(key, expired=True)
        if self._used + nbytes > HIGH_WATERMARK * self.capacity_bytes:
            victims, fits = plan_eviction(self._entries.values(), now, self.capacity_bytes, nbytes)
            for victim in victims:
                self._remove(victim, expired=is_expired(self._entries[victim], now))
            if not fits:
                self.refused_bytes += nbytes
                return
        self._entries[key] = Entry(key, nbytes, now, self.policy.expiry(None, now, cls))
        self._used += nbytes

    def collect(self, now: float) -> None:
        """Remove the expired entries (the store's ``collect`` / ``deepinfer kvstore gc``)."""
        for key in expired(self._entries.values(), now):
            self._remove(key, expired=True)

    def used_bytes(self, now: float) -> float:
        """Bytes held at ``now``, after collecting the expired entries."""
        self.collect(now)
        return self._used

    def _remove(self, key: Hashable, expired: bool) -> None:
        entry = self._entries.pop(key)
        self._used -= entry.size
        if expired:
            self.expired_bytes += entry.size
        else:
            self.evicted_bytes += entry.size


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
