"""Routing policies: pure functions of what the router knows, no I/O and no clock of their own.

The router (``deepinfer.router.app``) and the cluster simulator both drive them. Inputs:

- :class:`RequestInfo`: the request as the router sees it (estimated prompt tokens, token limit).
- :class:`WorkerView`: one worker at decision time: its URL and role, whether it is admitted, and
  its load as :class:`~deepinfer.router.loadbook.LoadBook` merges the worker's last report with the
  router's own dispatches since (prefill backlog in predicted seconds, active requests, KV tokens).

Policies pick one worker among candidates; :func:`plan` decides the path: straight to one worker
(short prompts go to a decode-capable worker, long ones to the least-loaded prefill-capable worker
that can also decode), or, once the KV handoff exists, two hops (prefill worker, then decode worker).
Ties break on the candidates' order, so a decision is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from deepinfer.core.roles import Role

if TYPE_CHECKING:
    from deepinfer.engine.cost_model import StepCostModel


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """A request to route: its prompt tokens (estimated by the router; all treated as uncached, since
    prefixes live in the shared store and any worker can load them) and its output token limit."""

    prompt_tokens: int
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as a policy sees it (see the module docstring)."""

    url: str
    role: Role
    cost_model: StepCostModel
    prefill_backlog_s: float = 0.0
    active_requests: int = 0
    kv_tokens_held: int = 0
    kv_capacity_tokens: int = 0
    admitted: bool = True  # healthy and not ejected
    kv_store_id: str = ""  # the shared KV store it hands blocks through ("": it cannot)
    slowdown: float = 1.0  # measured / predicted prompt seconds, learnt online (LoadBook)

    @property
    def can_prefill(self) -> bool:
        return self.role in (Role.PREFILL, Role.BOTH)

    @property
    def can_decode(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)

    def request_cost_s(self, request: RequestInfo) -> float:
        """Predicted compute of the request's prompt on this worker (its own cost model)."""
        return self.cost_model.marginal(request.prompt_tokens, 0)

    @property
    def expected_backlog_s(self) -> float:
        """The prompt work queued on the worker in real seconds: predicted backlog x slowdown."""
        return self.slowdown * self.prefill_backlog_s

    def expected_finish_s(self, request: RequestInfo) -> float:
        """Real seconds until this worker would have computed ``request``'s prompt after its backlog."""
        return self.slowdown * (self.prefill_backlog_s + self.request_cost_s(request))


class Policy(Protocol):
    """Chooses one of ``candidates`` (non-empty, all admitted) for ``request``."""

    name: str

    def choose(self, request: RequestInfo, candidates: Sequence[WorkerView]) -> WorkerView: ...


def _argmin(candidates: Sequence[WorkerView], key) -> WorkerView:
    return min(enumerate(candidates), key=lambda ic: (key(ic[1]), ic[0]))[1]


class EstimatedCompute:
    """Prefill: the lowest predicted queue time, i.e. the worker's queued prompt work plus this
    request's predicted cost on it, in seconds from each worker's own cost model (cache-agnostic),
    scaled by the worker's measured slowdown (:attr:`WorkerView.slowdown`). The router binds these
    choices late (:mod:`deepinfer.router.prefill_queue`): a request is placed only when a worker's
    backlog is under the horizon."""

    name = "estimated-compute"

    def choose(self, request: RequestInfo, candidates: Sequence[WorkerView]) -> WorkerView:
        return _argmin(candidates, lambda w: (w.expected_finish_s(request), w.active_requests))


class DecodeLoad:
    """Decode: the least loaded by KV tokens held plus ``request_weight_tokens`` per active request
    (request counts alone miss KV saturation; KV alone misses many short requests sharing a batch).
    Workers whose KV would exceed ``kv_limit`` of capacity with this request are avoided while
    another has room."""

    name = "decode-load"

    def __init__(self, request_weight_tokens: int = 256, kv_limit: float = 0.95) -> None:
        if request_weight_tokens < 0:
            raise ValueError(f"request_weight_tokens must be >= 0, got {request_weight_tokens}")
        if not 0 < kv_limit <= 1:
            raise ValueError(f"kv_limit must be in (0, 1], got {kv_limit}")
        self.request_weight_tokens = request_weight_tokens
        self.kv_limit = kv_limit

    def _fits(self, w: WorkerView, request: RequestInfo) -> bool:
        need = w.kv_tokens_held + request.prompt_tokens + (request.max_tokens or 0)
        return not w.kv_capacity_tokens or need <= self.kv_limit * w.kv_capacity_tokens

    def choose(self, request: RequestInfo, candidates: Sequence[WorkerView]) -> WorkerView:
        roomy = [w for w in candidates if self._fits(w, request)] or candidates
        return _argmin(roomy, lambda w: w.kv_tokens_held + self.request_weight_tokens * w.active_requests)


class LeastRequests:
    """Baseline: the fewest active requests."""

    name = "least-requests"

    def choose(self, request: RequestInfo, candidates: Sequence[WorkerView]) -> WorkerView:
        return _argmin(candidates, lambda w: w.active_requests)


class RoundRobin:
    """Baseline: each worker in turn (by URL, so admission changes keep the others' order)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, request: RequestInfo, candidates: Sequence[WorkerView]) -> WorkerView:
        ordered = sorted(candidates, key=lambda w: w.url)
        nxt = next((w for w in ordered if self._last is None or w.url > self._last), ordered[0])
        self._last = nxt.url
        return nxt


PREFILL_POLICIES = {p.name: p for p in (EstimatedCompute, LeastRequests, RoundRobin)}
PolicyName = Literal["estimated-compute", "least-requests", "round-robin"]


def prefill_policy(name: str) -> Policy:
    """A fresh prefill policy by name (``estimated-compute``, ``least-requests``, ``round-robin``)."""
    if name not in PREFILL_POLICIES:
        raise ValueError(f"unknown prefill policy {name!r} (accepted: {', '.join(PREFILL_POLICIES)})")
    return PREFILL_POLICIES[name]()


@dataclass(frozen=True, slots=True)
class Direct:
    """The whole request on one worker."""

    worker: WorkerView
    reason: Literal["short", "long"]


@dataclass(frozen=True, slots=True)
class TwoHop:
    """Prefill on one worker, KV handed off through the store, decode on another."""

    prefill: WorkerView
    decode: WorkerView


class NoWorker(Exception):
    """No admitted worker can serve the request (the message says which role is missing)."""


def handoff_pairs(workers: Sequence[WorkerView]) -> set[str]:
    """The store ids through which an admitted prefill-role worker can hand a prompt to an admitted
    decode-capable one (both report the same shared KV store)."""
    admitted = [w for w in workers if w.admitted and w.kv_store_id]
    prefill = {w.kv_store_id for w in admitted if w.role is Role.PREFILL}
    return prefill & {w.kv_store_id for w in admitted if w.can_decode}


def plan(
    request: RequestInfo,
    workers: Sequence[WorkerView],
    prefill: Policy,
    decode: Policy,
    min_disaggregated_tokens: int,
    handoff: bool = True,
) -> Direct | TwoHop:
    """Where ``request`` goes.

    A prompt shorter than ``min_disaggregated_tokens`` goes straight to a decode-capable worker
    (decode and both roles) by ``decode``. A longer one goes, when ``handoff`` (the request can be
    handed off) and an admitted prefill-role worker shares a KV store with an admitted
    decode-capable one (:func:`handoff_pairs`), to a prefill-capable worker of such a store by
    ``prefill``, then a decode-capable one of its store by ``decode``, another worker when there is
    one (:class:`TwoHop`); otherwise to one worker that can do both halves, by ``prefill``: a
    both-role worker when there is one, else a decode-role one.
    """
    admitted = [w for w in workers if w.admitted]
    decoders = [w for w in admitted if w.can_decode]
    if not decoders:
        have = ", ".join(sorted({w.role.value for w in admitted})) or "none"
        raise NoWorker(f"no admitted worker can decode (admitted roles: {have})")
    if request.prompt_tokens < min_disaggregated_tokens:
        return Direct(decode.choose(request, decoders), "short")
    stores = handoff_pairs(admitted) if handoff else set()
    if stores:
        first = prefill.choose(request, [w for w in admitted if w.can_prefill and w.kv_store_id in stores])
        same = [w for w in decoders if w.kv_store_id == first.kv_store_id and w.url != first.url]
        decode_side = [w for w in same if w.role is Role.DECODE] or same
        if decode_side:
            return TwoHop(first, decode.choose(request, decode_side))
    both = [w for w in decoders if w.role is Role.BOTH]
    return Direct(prefill.choose(request, both or decoders), "long")
