"""Measuring a run against a router: each worker's busy time over the run and the balance against a
perfect schedule (``deepinfer bench serve --url ROUTER``, ``bench/router_balance.py``).

Busy time is each worker's engine step time (``busy_s`` in its load report), read through the
router's ``GET /router/workers`` before and after the run. Balance is computed over the pool the
prefill policy places prompts on: the prefill-role workers when there are any (a disaggregated
cluster; each job's size is then its prompt's predicted compute, and the perfect schedule places every
prompt of the run, exact when every prompt takes two hops, as with ``--min-disaggregated-tokens 0``),
else (or when the prefill workers did no work) the workers that serve whole requests (both and decode roles; each job is its prompt and output).
A disaggregated run also reports ``decode_balance``, the same ratio over the decode-capable workers
(placed by the decode policy) with whole requests as jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.router.balance import balance, request_cost

SERVING_ROLES = ("both", "decode")


def _workers(url: str) -> dict[str, dict]:
    response = httpx.get(f"{url.rstrip('/')}/router/workers", timeout=10)
    response.raise_for_status()
    return response.json()


class BusyMeter:
    """Busy seconds of a router's workers between :meth:`attach` and :meth:`finish`."""

    def __init__(self, url: str, start: dict[str, dict]) -> None:
        self.url = url
        self.start = start

    @classmethod
    def attach(cls, url: str) -> BusyMeter | None:
        """A meter on the router at ``url``; ``None`` when ``url`` is not a router (a plain server)."""
        try:
            return cls(url, _workers(url))
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return None
            raise

    def finish(self, jobs: Sequence[tuple[int, int]]) -> dict:
        """Per-worker busy seconds since :meth:`attach` and the balance of ``jobs`` ((prompt tokens,
        output tokens) per completed request)."""
        end = _workers(self.url)
        busy = {u: end[u]["busy_s"] - self.start.get(u, {}).get("busy_s", 0.0) for u in end}
        serving = {u: s for u, s in busy.items() if end[u]["role"] in SERVING_ROLES}
        prefill = {u: s for u, s in busy.items() if end[u]["role"] == "prefill"}
        if not sum(prefill.values()):  # no prompt took two hops: only the serving pool did work
            prefill = {}
        model = StepCostModel(**next(iter(end.values()))["cost_model"])
        whole = [request_cost(model, p, o) for p, o in jobs]
        if prefill:
            result = balance(prefill, [model.marginal(p, 0) for p, _ in jobs]).as_dict()
            result["decode_balance"] = balance(serving, whole).balance
        else:
            result = balance(serving, whole).as_dict()
        result["pool"] = "prefill" if prefill else "serving"
        result["busy_s_all"] = busy
        result["cost_model"] = model.source
        return result
