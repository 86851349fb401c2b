"""The prefill->decode handoff, the router's side: the messages it exchanges with the two workers
and one state machine per request. Pure (no I/O; callers pass the time).

The flow (the workers' side: :mod:`deepinfer.server.kv_transfer`; the router takes it when a prefill
worker and a decode worker report the same shared KV store, see ``Proxy.handoff_ready``):

1. Router -> prefill worker: the client's body with ``stream: false``, ``max_tokens: 1`` and
   ``kv_transfer`` = :class:`PrefillOrder` (handoff id, the request's deadline, the lease to take).
2. The prefill worker computes the prompt, saves its KV blocks to the shared store under a lease, and
   answers with ``kv_transfer`` = :class:`PrefillResult` (first token, block keys, layout, lease expiry).
3. Router -> decode worker: the client's original body with ``kv_transfer`` = :class:`DecodeOrder`.
   The decode worker loads the blocks (recomputing any missing or corrupt one, counted), acks the
   lease (the store frees it) and streams the answer, which the router relays.
4. On any failure the router retries where nothing has reached the client (another prefill worker;
   another decode worker while the lease holds), else ends the request with an error; a lease no
   decode worker picked up expires in the store; the router also releases it (idempotent) once the
   handoff ends without decode's ack.

States: ``planned -> prefilling -> prefilled -> decoding -> streaming -> done``, with the terminal
``failed`` (any state; the deadline, or retries exhausted) and ``expired`` (the lease ran out before
decode loaded). Each transition checks its source state; an illegal one raises :class:`HandoffError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from deepinfer.web.handoff import DecodeOrder, PrefillOrder, PrefillResult


class HandoffState(str, Enum):
    PLANNED = "planned"  # workers chosen, nothing sent
    PREFILLING = "prefilling"  # PrefillOrder sent
    PREFILLED = "prefilled"  # PrefillResult received: KV in the store under a lease
    DECODING = "decoding"  # DecodeOrder sent; decode loads the KV
    STREAMING = "streaming"  # decode produced output: the client has bytes, no more retries
    DONE = "done"  # decode finished and acked the lease
    FAILED = "failed"  # the client gets an error
    EXPIRED = "expired"  # the lease ran out before decode loaded; the store freed the blocks

    @property
    def terminal(self) -> bool:
        return self in (HandoffState.DONE, HandoffState.FAILED, HandoffState.EXPIRED)


class HandoffError(ValueError):
    """An illegal transition or an answer that does not belong to this handoff."""


@dataclass(slots=True)
class Handoff:
    """One request's handoff (see the module docstring). Times are the caller's clock (unix seconds,
    as the messages carry them)."""

    handoff_id: str
    deadline: float
    lease_s: float
    kv_layout: str
    max_prefill_attempts: int = 2
    max_decode_attempts: int = 2
    state: HandoffState = HandoffState.PLANNED
    prefill_workers: list[str] = field(default_factory=list)  # tried, in order
    decode_workers: list[str] = field(default_factory=list)
    result: PrefillResult | None = None
    failure: str | None = None
    _released: bool = False

    def _expect(self, *states: HandoffState) -> None:
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise HandoffError(f"handoff {self.handoff_id}: {self.state.value}, expected {allowed}")

    def _fail(self, reason: str) -> None:
        self.state, self.failure = HandoffState.FAILED, reason

    def tick(self, now: float) -> HandoffState:
        """Apply the deadline and the lease; returns the state."""
        if self.state.terminal:
            return self.state
        if now >= self.deadline:
            self._fail("the request's deadline passed")
        elif self.state is HandoffState.PREFILLED and now >= self.result.lease_expires_unix:
            self.state, self.failure = HandoffState.EXPIRED, "the lease expired before decode loaded the KV"
        return self.state

    def start_prefill(self, worker: str, now: float) -> PrefillOrder:
        self._expect(HandoffState.PLANNED)
        if self.tick(now).terminal:
            raise HandoffError(f"handoff {self.handoff_id}: {self.failure}")
        self.prefill_workers.append(worker)
        self.state = HandoffState.PREFILLING
        return PrefillOrder(self.handoff_id, self.deadline, self.lease_s)

    def prefilled(self, result: PrefillResult, now: float) -> None:
        self._expect(HandoffState.PREFILLING)
        if result.handoff_id != self.handoff_id:
            raise HandoffError(f"handoff {self.handoff_id}: an answer for {result.handoff_id}")
        if result.kv_layout != self.kv_layout:
            raise HandoffError(
                f"handoff {self.handoff_id}: KV written in layout {result.kv_layout}, not {self.kv_layout}"
            )
        self.result, self.state = result, HandoffState.PREFILLED
        self.tick(now)

    def prefill_failed(self, reason: str, now: float) -> bool:
        """The prefill attempt failed; True when another prefill worker may be tried."""
        self._expect(HandoffState.PREFILLING)
        if len(self.prefill_workers) >= self.max_prefill_attempts:
            self._fail(f"prefill failed on {len(self.prefill_workers)} workers (last: {reason})")
            return False
        self.state = HandoffState.PLANNED
        return not self.tick(now).terminal

    def start_decode(self, worker: str, now: float) -> DecodeOrder:
        self._expect(HandoffState.PREFILLED)
        if self.tick(now).terminal:
            raise HandoffError(f"handoff {self.handoff_id}: {self.failure}")
        self.decode_workers.append(worker)
        self.state = HandoffState.DECODING
        r = self.result
        return DecodeOrder(self.handoff_id, r.first_token_id, r.block_keys, r.num_prompt_tokens, r.num_cached_tokens,
                           r.kv_layout, r.lease_expires_unix, self.deadline)  # fmt: skip

    def decode_output(self) -> None:
        """The decode worker produced output (the client now has bytes)."""
        self._expect(HandoffState.DECODING, HandoffState.STREAMING)
        self.state = HandoffState.STREAMING

    def decode_failed(self, reason: str, now: float) -> bool:
        """The decode attempt failed; True when another decode worker may be tried (nothing
        streamed, the lease still holds, attempts left)."""
        self._expect(HandoffState.DECODING, HandoffState.STREAMING)
        if self.state is HandoffState.STREAMING or len(self.decode_workers) >= self.max_decode_attempts:
            self._fail(f"decode failed on {self.decode_workers[-1]}: {reason}")
            return False
        self.state = HandoffState.PREFILLED
        return not self.tick(now).terminal

    def finished(self) -> None:
        """Decode finished and acked the lease."""
        self._expect(HandoffState.STREAMING, HandoffState.DECODING)
        self.state = HandoffState.DONE
        self._released = True  # decode's ack freed it

    def abandon(self, reason: str) -> None:
        """The router gives up on the handoff (no worker left for it, or the request was cancelled):
        ``failed`` unless it already ended."""
        if not self.state.terminal:
            self._fail(reason)

    def take_release(self) -> str | None:
        """Once the handoff has ended without decode's ack, after a prefill was sent (it may have saved
        blocks even if its answer never came): the handoff id whose lease the router releases at the
        prefill side (``POST /kv/release``, idempotent there). ``None`` otherwise, and
        on every later call."""
        if not self.state.terminal or self._released or not self.prefill_workers:
            return None
        self._released = True
        return self.handoff_id
