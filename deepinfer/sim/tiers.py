"""The KV cache tiers below a worker's device memory: host memory and the shared store.

Created by the simulator with one :class:`~deepinfer.sim.policies.TierRetention` per tier (the KV
store's own retention policy: per-class TTLs, watermark eviction); the device tier is not here (it is the engine's own block pool inside each simulated rank). Granularity
is the workload's prompt segment (a system prefix, one earlier turn): a segment's blocks are written
and read together, so a segment is held whole or not at all, and a prompt hits the longest chain of
held segments from its start. Every finished request writes its prompt's segments and its own turn
through to every tier (DeepSeek persists all KV to 3FS); a hit refreshes the entry for the hitting
request's traffic class, as the store's tiers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.sim.policies import TierRetention
from deepinfer.sim.workload import Arrival, Segment


@dataclass(slots=True)
class Tier:
    name: str
    policy: TierRetention
    read_bytes_per_s: float  # into device memory


@dataclass(slots=True)
class TierHit:
    tokens: dict[str, int] = field(default_factory=dict)  # tier name -> prompt tokens found there
    load_s: float = 0.0  # time to bring the hit into device memory


class TieredStore:
    def __init__(self, tiers: list[Tier], kv_bytes_per_token: float) -> None:
        self.tiers = tiers
        self.kv_bytes_per_token = kv_bytes_per_token

    def lookup(self, arrival: Arrival, skip_tokens: int, now: float) -> TierHit:
        """Which of the prompt's leading segments each tier supplies, past the first ``skip_tokens``
        (already on the device); stops at the first segment no tier holds. The turn's new input (the
        last segment) is never cached."""
        hit = TierHit({t.name: 0 for t in self.tiers})
        position = 0
        for segment in arrival.segments[:-1]:
            end = position + segment.tokens
            source = next(
                (t for t in self.tiers if t.policy.contains(segment.key, arrival.traffic_class, now)), None
            )
            if source is None:
                break
            if end > skip_tokens:
                fresh = end - max(position, skip_tokens)
                hit.tokens[source.name] += fresh
                hit.load_s += fresh * self.kv_bytes_per_token / source.read_bytes_per_s
            position = end
        return hit

    def write(self, arrival: Arrival, now: float) -> None:
        """Write through the prompt's segments and the turn that the session's next request carries."""
        turn = Segment(
            ("turn", arrival.segments[-1].key, arrival.segments[-1].tokens, arrival.request_id),
            arrival.segments[-1].tokens + arrival.output_tokens,
        )
        for segment in (*arrival.segments[:-1], turn):
            nbytes = segment.tokens * self.kv_bytes_per_token
            for tier in self.tiers:
                tier.policy.save(segment.key, nbytes, arrival.traffic_class, now)

    def occupancy(self, now: float) -> dict[str, float]:
        return {t.name: t.policy.used_bytes(now) for t in self.tiers}
