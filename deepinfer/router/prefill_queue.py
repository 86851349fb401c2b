"""Late binding of prefills: the router's bounded queue of long prompts not yet placed on a worker.

Binding each request to a worker at arrival, from predictions alone, turns every speed difference (a
worker slowed by a process sharing its cores, a cost model that is off) into imbalance: the slow worker
keeps receiving its share. Instead, as with one shared queue in front of identical servers, a long
prompt is placed only when a worker can start on it soon: the prefill policy's choice must have an
expected backlog (predicted seconds x its measured slowdown, :attr:`WorkerView.expected_backlog_s`)
under ``horizon_s``, which keeps that worker busy until the next request reaches it. Until then the
request waits here. The end of every prefill the router sees, every load report and every placement
wakes the queue (:meth:`PrefillQueue.kick`), so work goes to whichever worker really frees up first.

Order: a waiting request's key is its arrival time minus its expected prompt seconds (one second of
predicted work counts as one second waited); the smallest key goes first. Long prompts are thus placed
early and short ones fill the gaps at the end, as longest-processing-time-first does offline, yet a
request is overtaken only by requests that are longer than it by more than they arrived after it:
nothing starves. With an empty queue and a worker under the horizon a request is placed at once, so
low load sees no added latency. The queue holds at most ``limit`` requests; beyond them
:class:`QueueFull` (the router answers 429 with Retry-After). Waiting ends at the request's deadline
(``TimeoutError``) or when its task is cancelled (the client went away); either way it leaves the queue.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The router's prefill queue holds ``limit`` requests already."""


@dataclass(order=True, slots=True)
class _Entry:
    key: float  # arrival time - expected prompt seconds
    seq: int  # arrival order among equal keys


class PrefillQueue:
    """See the module docstring. One per router; every method runs on the router's event loop."""

    def __init__(
        self,
        horizon_s: float,
        limit: int,
        recheck_s: float,
        on_wait: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if recheck_s <= 0:
            raise ValueError(f"recheck_s must be > 0, got {recheck_s}")
        self.horizon_s = horizon_s
        self.limit = limit
        self.recheck_s = recheck_s  # the head looks again this often even when nothing wakes it
        self.on_wait = on_wait  # called for each request that could not be placed at once
        self.clock = clock
        self._entries: list[_Entry] = []
        self._seq = itertools.count()
        self._wake: asyncio.Future | None = None

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._entries)

    def under_horizon(self, expected_backlog_s: float) -> bool:
        """Whether a worker with this much expected prompt work may take one more request."""
        return expected_backlog_s < self.horizon_s

    def kick(self) -> None:
        """Something changed (a prefill ended, a report came, a request was placed): the head looks again."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def place(self, attempt: Callable[[], T | None], cost_s: float, timeout_s: float) -> T:
        """Wait for this request's turn and a worker: ``attempt()`` (synchronous, so nothing changes
        between its check and its booking) returns the placement, or ``None`` while no worker is under
        the horizon; it is called only for the head of the queue. ``cost_s``: the request's expected
        prompt seconds (its priority). Raises :class:`QueueFull`, ``TimeoutError`` after
        ``timeout_s``, or whatever ``attempt`` raises."""
        if not self._entries:
            placed = attempt()
            if placed is not None:
                return placed
        if len(self._entries) >= self.limit:
            raise QueueFull(f"{self.limit} requests are already waiting for a prefill worker")
        now = self.clock()
        entry = _Entry(now - max(0.0, cost_s), next(self._seq))
        bisect.insort(self._entries, entry)
        self.on_wait()
        deadline = now + timeout_s
        try:
            while True:
                if self._entries[0] is entry:
                    placed = attempt()
                    if placed is not None:
                        return placed
                left = deadline - self.clock()
                if left <= 0:
                    raise TimeoutError("the request's deadline passed while it waited for a prefill worker")
                if self._wake is None or self._wake.done():
                    self._wake = asyncio.get_running_loop().create_future()
                await asyncio.wait([self._wake], timeout=min(left, self.recheck_s))
        finally:
            self._entries.remove(entry)
            self.kick()  # the next head may be placeable now
