"""The router's view of each worker's load: the worker's last report, corrected by what this router
has done since.

Reports arrive every poll interval; requests arrive faster. Between two reports the router adds what
it dispatched after the report was requested (the worker did not know it yet) and takes off what
finished after it (the report still counts it). A report also lags behind the worker itself: its
engine figures are from the end of the engine's last step, and a request the server admitted during
that step reaches the engine only after it. The report says how many such requests there are (admitted
by the server, ``num_in_flight``, minus those in the engine), and the router counts its own most recent
dispatches before the report as those. So a burst of requests spreads across workers instead of piling
onto the one that looked idle at the last poll, nothing is counted twice, and several router replicas
still see each other's load at the next report.

The book also learns how fast each worker really computes prompts: between two of its reports, the
engine seconds it spent (``busy_s``) against the predicted seconds of the prompts whose end the router
saw in that time (:meth:`LoadBook.prefilled`, or the request's end). Decayed sums of both give the
worker's ``slowdown``, real seconds per predicted second (until a worker has done predicted work,
the median of its peers', or 1.0): a worker slowed by a neighbour on its cores, by its own decodes, or a cost model that is off
by a constant shows up in its view, while the per-hop overhead (HTTP, handing the KV to the store)
stays out of it (an ejection resets it). Pure bookkeeping: callers pass the time (``now``), nothing here
reads a clock or does I/O, so the simulator drives it with its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.core.load import WorkerLoad
from deepinfer.router.policies import WorkerView


@dataclass(slots=True)
class _Dispatch:
    sent_at: float
    prefill_s: float  # predicted prompt compute on the chosen worker
    kv_tokens: int  # prompt tokens: KV the worker will hold once the prompt is computed
    prefilled_at: float | None = None  # first output byte seen
    finished_at: float | None = None


@dataclass(slots=True)
class _Worker:
    report: WorkerLoad
    reported_at: float  # when the report was requested
    admitted: bool = True
    done_s: float = 0.0  # predicted seconds of the prompts seen to end, in all
    done_at_report_s: float = 0.0  # done_s when the report was taken in
    busy_s: float = 0.0  # decayed sum of engine seconds between reports
    busy_done_s: float = 0.0  # decayed sum of done_s between reports

    @property
    def slowdown(self) -> float | None:
        """Real seconds per predicted second; ``None`` until the worker has done predicted work."""
        if self.busy_done_s <= 0:
            return None
        return min(SLOWDOWN_RANGE[1], max(SLOWDOWN_RANGE[0], self.busy_s / self.busy_done_s))

    def prompt_done(self, d: _Dispatch, now: float) -> None:
        d.prefilled_at = now
        self.done_s += d.prefill_s

    def took_in(self, report: WorkerLoad, requested_at: float) -> None:
        busy = report.engine.busy_s - self.report.engine.busy_s
        if busy >= 0:  # (a restarted worker starts its count again)
            done = self.done_s - self.done_at_report_s
            self.busy_s = SLOWDOWN_DECAY * self.busy_s + busy
            self.busy_done_s = SLOWDOWN_DECAY * self.busy_done_s + done
        self.done_at_report_s = self.done_s
        self.report, self.reported_at = report, requested_at


SLOWDOWN_DECAY = 0.9  # weight of the past per report (reports come every poll interval)
SLOWDOWN_RANGE = (1e-3, 1e3)  # a worker's slowdown is clipped to this (a cost model off by 1000x is broken)


class LoadBook:
    """Per-worker load views; see the module docstring."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._dispatches: dict[str, dict[str, _Dispatch]] = {}

    def __contains__(self, url: str) -> bool:
        return url in self._workers

    def urls(self) -> list[str]:
        return list(self._workers)

    def report(self, url: str) -> WorkerLoad:
        return self._workers[url].report

    def observe(self, url: str, report: WorkerLoad, requested_at: float) -> None:
        """A load report for ``url``, requested at ``requested_at``. Dispatches that finished before
        it are forgotten (the report reflects them)."""
        worker = self._workers.get(url)
        if worker is None:
            self._workers[url] = _Worker(report, requested_at)
            self._dispatches[url] = {}
        else:
            worker.took_in(report, requested_at)
        book = self._dispatches[url]
        for rid in [
            r for r, d in book.items() if d.finished_at is not None and d.finished_at <= requested_at
        ]:
            del book[rid]

    def set_admitted(self, url: str, admitted: bool) -> None:
        """Admit or eject ``url``. A re-admitted worker learns its slowdown again (what it learnt spans
        the outage: a stopped worker's step counts its whole stop), taking its peers' meanwhile."""
        worker = self._workers[url]
        if admitted and not worker.admitted:
            worker.busy_s = worker.busy_done_s = 0.0
        worker.admitted = admitted

    def admitted(self, url: str) -> bool:
        return self._workers[url].admitted

    def remove(self, url: str) -> None:
        self._workers.pop(url, None)
        self._dispatches.pop(url, None)

    # ------------------------------------------------------------------ this router's requests
    def dispatched(self, url: str, request_id: str, prefill_s: float, kv_tokens: int, now: float) -> None:
        self._dispatches[url][request_id] = _Dispatch(now, prefill_s, kv_tokens)

    def prefilled(self, url: str, request_id: str, now: float) -> None:
        """The worker produced the request's first output: its prompt is computed."""
        d = self._dispatches.get(url, {}).get(request_id)
        if d is not None and d.prefilled_at is None:
            self._workers[url].prompt_done(d, now)

    def finished(self, url: str, request_id: str, now: float) -> None:
        """The request ended on ``url`` (done, failed or abandoned); idempotent."""
        d = self._dispatches.get(url, {}).get(request_id)
        if d is None or d.finished_at is not None:
            return
        d.finished_at = now
        if d.prefilled_at is None:
            self._workers[url].prompt_done(d, now)
        if d.sent_at >= self._workers[url].reported_at:  # never in a report: nothing to correct
            del self._dispatches[url][request_id]

    # ------------------------------------------------------------------ views
    def view(self, url: str) -> WorkerView:
        """``url`` as a policy sees it now."""
        worker = self._workers[url]
        r, t = worker.report, worker.reported_at
        backlog, active, kv = r.prefill_backlog_s, r.active_requests, r.engine.kv_tokens_held
        dispatches = self._dispatches[url].values()
        pending = max(0, r.num_in_flight - r.engine.num_running - r.engine.num_waiting)
        before = sorted((d for d in dispatches if d.sent_at < t), key=lambda d: d.sent_at, reverse=True)
        not_in_engine = {id(d) for d in before[:pending]}
        for d in dispatches:
            if d.sent_at >= t or id(d) in not_in_engine:  # unknown to the engine figures
                if d.prefilled_at is None:
                    backlog += d.prefill_s
                if d.finished_at is None:
                    kv += d.kv_tokens
                    active += d.sent_at >= t  # num_in_flight counts the others
                elif d.sent_at < t:
                    active -= 1
            else:  # counted by the report: take off what has ended since
                if d.prefilled_at is not None and d.prefilled_at >= t:
                    backlog -= d.prefill_s
                if d.finished_at is not None:
                    active -= 1
                    kv -= d.kv_tokens
        return WorkerView(
            url=url,
            role=r.role,
            cost_model=r.cost_model.step_model(),
            prefill_backlog_s=max(0.0, backlog),
            active_requests=max(0, active),
            kv_tokens_held=max(0, kv),
            kv_capacity_tokens=r.engine.kv_capacity_tokens,
            admitted=worker.admitted and r.healthy,
            kv_store_id=r.kv_store_id,
            slowdown=worker.slowdown if worker.slowdown is not None else self._peer_slowdown(),
        )

    def views(self) -> list[WorkerView]:
        return [self.view(url) for url in self._workers]

    def _peer_slowdown(self) -> float:
        """The median slowdown of the workers that know theirs (1.0 when none does)."""
        known = sorted(s for w in self._workers.values() if (s := w.slowdown) is not None)
        if not known:
            return 1.0
        mid = len(known) // 2
        return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2
