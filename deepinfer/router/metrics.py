"""Prometheus metrics of the router (``GET /metrics`` on ``deepinfer router``).

Counters are recorded as requests are routed and fail; the prefill queue's depth is read from it;
per-worker gauges (admitted, active requests, predicted prefill backlog, measured slowdown, KV tokens
held, busy seconds) are read from the registry's load book at
scrape time. Each router owns its registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.router.policies import WorkerView

FAILURE_KINDS = (
    "connect",
    "timeout",
    "ejected",
    "worker_status",
    "mid_stream",
    "no_worker",
    "deadline",
    "health",
    "handoff",
    "queue_full",
)
HANDOFF_OUTCOMES = ("done", "failed", "expired")  # deepinfer.router.handoff's terminal states


class _WorkerCollector(Collector):
    def __init__(self, views: Callable[[], list[tuple[WorkerView, float]]]) -> None:
        self._views = views

    def collect(self) -> Iterator[Metric]:
        views = self._views()
        families = {
            "admitted": GaugeMetricFamily(
                "deepinfer_router_worker_admitted",
                "1 while the worker is admitted",
                labels=["worker", "role"],
            ),
            "active": GaugeMetricFamily(
                "deepinfer_router_worker_active_requests",
                "Active requests (router's view)",
                labels=["worker", "role"],
            ),
            "backlog": GaugeMetricFamily(
                "deepinfer_router_worker_prefill_backlog_seconds",
                "Predicted prompt compute queued on the worker (router's view)",
                labels=["worker", "role"],
            ),
            "slowdown": GaugeMetricFamily(
                "deepinfer_router_worker_prefill_slowdown",
                "Measured / predicted prompt seconds, learnt from the prefills the router saw end",
                labels=["worker", "role"],
            ),
            "kv": GaugeMetricFamily(
                "deepinfer_router_worker_kv_tokens",
                "KV tokens held (router's view)",
                labels=["worker", "role"],
            ),
        }
        busy = CounterMetricFamily(
            "deepinfer_router_worker_busy_seconds",
            "Engine step time the worker reports",
            labels=["worker", "role"],
        )
        for view, busy_s in views:
            labels = [view.url, view.role.value]
            families["admitted"].add_metric(labels, float(view.admitted))
            families["active"].add_metric(labels, view.active_requests)
            families["backlog"].add_metric(labels, view.prefill_backlog_s)
            families["slowdown"].add_metric(labels, view.slowdown)
            families["kv"].add_metric(labels, view.kv_tokens_held)
            busy.add_metric(labels, busy_s)
        yield from families.values()
        yield busy


class RouterMetrics:
    """The router's registry and counters."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "deepinfer_router_requests",
            "Requests that ended, by API, path taken and outcome: ok, error (also a stream that broke or "
            "carried an error event after its first output), cancelled (the client left a stream before its end)",
            ["api", "path", "outcome"],
            registry=r,
        )
        self.dispatched = Counter(
            "deepinfer_router_dispatched", "Attempts sent to each worker", ["worker"], registry=r
        )
        self.retries = Counter("deepinfer_router_retries", "Attempts after a request's first", registry=r)
        self.failures = Counter(
            "deepinfer_router_failures",
            "Failures seen by the router: connect, timeout, ejected (worker ejected mid-attempt), worker_status "
            "(a retryable HTTP status), mid_stream, no_worker, deadline, health (failed load polls), handoff (a "
            "prefill answer without a valid handoff result), queue_full (the prefill queue was full: 429)",
            ["kind"],
            registry=r,
        )
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        self.handoffs = Counter(
            "deepinfer_router_handoffs",
            "Prefill->decode handoffs that ended, by terminal state (failed ones fall back to one worker)",
            ["outcome"],
            registry=r,
        )
        for outcome in HANDOFF_OUTCOMES:
            self.handoffs.labels(outcome=outcome)
        self.prefill_queue_depth = Gauge(
            "deepinfer_router_prefill_queue_depth",
            "Long prompts waiting in the router for a prefill worker (late binding)",
            registry=r,
        )
        self.prefill_queued = Counter(
            "deepinfer_router_prefill_queued",
            "Long prompts that could not be placed at arrival and waited in the router",
            registry=r,
        )
        self.ejections = Counter("deepinfer_router_ejections", "Workers ejected", ["worker"], registry=r)
        self.readmissions = Counter(
            "deepinfer_router_readmissions", "Ejected workers re-admitted", ["worker"], registry=r
        )

    def watch_workers(self, views: Callable[[], list[tuple[WorkerView, float]]]) -> None:
        self.registry.register(_WorkerCollector(views))

    def render(self) -> bytes:
        return generate_latest(self.registry)
