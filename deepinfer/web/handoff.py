"""The prefill->decode handoff's wire messages: the ``kv_transfer`` objects the router sends to and
receives from workers. Created by the router's :class:`~deepinfer.router.handoff.Handoff` (orders) and
by a prefill worker's :mod:`deepinfer.server.kv_transfer` (the result); they travel as JSON inside
the request and response bodies and live only on the host.
"""

from __future__ import annotations

import msgspec

# The longest lease a worker grants (seconds): a lease holds blocks against eviction, so a worker refuses
# an order asking for more (the router's --kv-lease-s is bounded by it too).
MAX_LEASE_S = 600.0


class PrefillOrder(msgspec.Struct, frozen=True):
    """``kv_transfer`` in the body sent to the prefill worker."""

    handoff_id: str
    deadline_unix: float  # the client request's deadline: no work past it (finite)
    lease_s: float  # how long the store holds the blocks for decode: finite, > 0, <= MAX_LEASE_S


class PrefillResult(msgspec.Struct, frozen=True):
    """``kv_transfer`` in the prefill worker's answer."""

    handoff_id: str
    first_token_id: int
    block_keys: list[str]  # content-addressed store keys of the prompt's KV blocks, in order
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefill worker found in the store (reported in usage)
    kv_layout: str  # the KV layout fingerprint the blocks were written in
    lease_expires_unix: float


class DecodeOrder(msgspec.Struct, frozen=True):
    """``kv_transfer`` in the body sent to the decode worker."""

    handoff_id: str
    first_token_id: int
    block_keys: list[str]
    num_prompt_tokens: int
    num_cached_tokens: int  # the prefill's cache hits: what the decode worker's usage reports as cached
    kv_layout: str
    lease_expires_unix: float
    deadline_unix: float
