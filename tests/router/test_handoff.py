"""The router's handoff state machine: happy path, retries, lease expiry, deadline, idempotent release."""

from __future__ import annotations

import pytest

from deepinfer.router.config import RouterConfig
from deepinfer.router.handoff import Handoff, HandoffError, HandoffState
from deepinfer.web.handoff import MAX_LEASE_S, PrefillResult


def result(hid: str = "h", expires: float = 50.0, layout: str = "L") -> PrefillResult:
    return PrefillResult(hid, 42, ["k0", "k1"], 40, 8, layout, expires)


def handoff(**kw) -> Handoff:
    return Handoff("h", deadline=100.0, lease_s=30.0, kv_layout="L", **kw)


def test_happy_path_carries_the_deadline_and_needs_no_router_release() -> None:
    h = handoff()
    order = h.start_prefill("p1", now=0.0)
    assert (order.handoff_id, order.deadline_unix, order.lease_s) == ("h", 100.0, 30.0)
    h.prefilled(result(), now=1.0)
    decode = h.start_decode("d1", now=2.0)
    assert (decode.first_token_id, decode.block_keys, decode.deadline_unix) == (42, ["k0", "k1"], 100.0)
    h.decode_output()
    h.finished()
    assert h.state is HandoffState.DONE and h.take_release() is None


def test_prefill_retry_then_give_up_and_release_once() -> None:
    h = handoff(max_prefill_attempts=2)
    h.start_prefill("p1", 0.0)
    assert h.prefill_failed("connection refused", 1.0) and h.state is HandoffState.PLANNED
    h.start_prefill("p2", 1.0)
    assert not h.prefill_failed("timeout", 2.0)
    assert h.state is HandoffState.FAILED and "2 workers" in h.failure
    assert h.take_release() == "h" and h.take_release() is None  # p2 may have saved blocks: freed once


def test_decode_retry_only_before_output_and_while_the_lease_holds() -> None:
    h = handoff(max_decode_attempts=3)
    h.start_prefill("p", 0.0)
    h.prefilled(result(expires=10.0), 1.0)
    h.start_decode("d1", 2.0)
    assert h.decode_failed("died before output", 3.0) and h.state is HandoffState.PREFILLED
    h.start_decode("d2", 4.0)
    h.decode_output()
    assert not h.decode_failed("died mid-stream", 5.0) and h.state is HandoffState.FAILED
    assert h.take_release() == "h"
    late = handoff()
    late.start_prefill("p", 0.0)
    late.prefilled(result(expires=10.0), 1.0)
    late.start_decode("d1", 2.0)
    assert not late.decode_failed("died", now=11.0)  # the lease is gone: no second decode
    assert late.state is HandoffState.EXPIRED


def test_lease_expiry_and_deadline() -> None:
    h = handoff()
    h.start_prefill("p", 0.0)
    h.prefilled(result(expires=10.0), 1.0)
    assert h.tick(9.9) is HandoffState.PREFILLED
    assert h.tick(10.0) is HandoffState.EXPIRED  # decode never pulled
    with pytest.raises(HandoffError, match="expected prefilled"):
        h.start_decode("d", 11.0)
    assert h.take_release() == "h" and h.take_release() is None
    d = handoff()
    d.start_prefill("p", 0.0)
    assert d.tick(100.0) is HandoffState.FAILED and "deadline" in d.failure


def test_answers_that_do_not_belong_are_refused() -> None:
    h = handoff()
    with pytest.raises(HandoffError, match="planned, expected prefilling"):
        h.prefilled(result(), 0.0)
    h.start_prefill("p", 0.0)
    with pytest.raises(HandoffError, match="an answer for other"):
        h.prefilled(result(hid="other"), 1.0)
    with pytest.raises(HandoffError, match="layout X"):
        h.prefilled(result(layout="X"), 1.0)
    assert h.take_release() is None  # not ended


def test_abandon_ends_an_unfinished_handoff_and_releases_once() -> None:
    h = handoff()
    h.start_prefill("p1", 0.0)
    assert h.prefill_failed("refused", 1.0)  # another prefill worker may be tried, but none is left
    h.abandon("no worker left")
    assert h.state is HandoffState.FAILED and h.failure == "no worker left"
    assert h.take_release() == "h" and h.take_release() is None
    done = handoff()
    done.start_prefill("p1", 0.0)
    done.prefilled(result(), 1.0)
    done.start_decode("d1", 2.0)
    done.finished()
    done.abandon("late")  # already ended: unchanged
    assert done.state is HandoffState.DONE and done.take_release() is None


def test_orders_carry_the_prefills_cache_hits_and_a_lease_workers_accept() -> None:
    """The decode order tells the decode worker what the prefill worker found cached (its usage
    reports that, not the blocks the handoff delivered); the router's lease is one workers take:
    finite, over 0, at most MAX_LEASE_S (issue 34, defects 4 and 7)."""
    h = handoff()
    h.start_prefill("p1", now=0.0)
    h.prefilled(result(), now=1.0)
    assert h.start_decode("d1", now=2.0).num_cached_tokens == 8
    for lease in (float("nan"), float("inf"), 0.0, MAX_LEASE_S + 1):
        with pytest.raises(ValueError, match="kv_lease_s"):
            RouterConfig(kv_lease_s=lease)
    assert RouterConfig(kv_lease_s=MAX_LEASE_S).kv_lease_s == MAX_LEASE_S
