"""Prometheus metrics of the server (``GET /metrics``).

Engine state (running / waiting requests, KV-cache usage, prefix-cache hits) is read at scrape time
from the engine cores' last :class:`~deepinfer.core.messages.EngineStats`; request latencies
and token counts are recorded as each request progresses (:class:`RequestMeter`). Each server owns
its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from deepinfer.core.messages import EngineStats
from deepinfer.outputs import RequestOutput
from deepinfer.server.kv_store_metrics import kv_store_families

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        in_flight: Callable[[], int],
        per_core: Callable[[], dict[int, EngineStats]],
        dropped_messages: Callable[[], int],
        weight_bytes: Callable[[], int],
    ) -> None:
        self._stats = stats
        self._in_flight = in_flight
        self._per_core = per_core
        self._dropped_messages = dropped_messages
        self._weight_bytes = weight_bytes

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        cores = self._per_core()
        yield GaugeMetricFamily(
            "deepinfer_num_requests_running", "Requests in the engine's running batch", value=s.num_running
        )
        yield GaugeMetricFamily(
            "deepinfer_num_requests_waiting", "Requests waiting in the engine's queue", value=s.num_waiting
        )
        yield GaugeMetricFamily(
            "deepinfer_num_requests_in_flight",
            "Requests admitted by the server, not finished",
            value=self._in_flight(),
        )
        yield GaugeMetricFamily(
            "deepinfer_kv_cache_usage_ratio",
            "Share of KV-cache blocks held by requests (0..1)",
            value=s.kv_cache_usage,
        )
        yield CounterMetricFamily(
            "deepinfer_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_queries,
        )
        yield CounterMetricFamily(
            "deepinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache", value=s.prefix_hits
        )
        yield CounterMetricFamily(
            "deepinfer_engine_channel_dropped_messages",
            "Frames from the engine-core channel dropped as malformed or not their sender's to send",
            value=self._dropped_messages(),
        )
        yield GaugeMetricFamily(
            "deepinfer_model_weight_bytes",
            "Bytes of model weights the engine cores hold, as stored (FP8 / MXFP4 values plus scales)",
            value=self._weight_bytes(),
        )
        rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        yield GaugeMetricFamily(
            "deepinfer_prefix_cache_hit_rate", "Prefix-cache hits / queries since start", value=rate
        )
        spec = s.spec
        for name, help_text, value in (
            ("draft_tokens", "Speculative draft tokens proposed", spec.draft_tokens),
            (
                "verified_tokens",
                "Speculative draft tokens verified by the target model",
                spec.verified_tokens,
            ),
            ("accepted_tokens", "Speculative draft tokens accepted", spec.accepted_tokens),
        ):
            yield CounterMetricFamily(f"deepinfer_spec_decode_{name}", help_text, value=value)
        yield GaugeMetricFamily(
            "deepinfer_spec_decode_mean_accepted_length",
            "Tokens emitted per request per step (accepted drafts + 1; 1 without speculation), since start",
            value=spec.mean_accepted_len,
        )
        if len(cores) > 1:
            yield from _rank_families(cores)
        stores = {str(i): c.kv_store for i, c in cores.items() if c.kv_store is not None}
        if len(cores) > 1 and stores:
            yield from kv_store_families(stores)
        elif s.kv_store is not None:
            yield from kv_store_families({None: s.kv_store})


def _rank_families(cores: dict[int, EngineStats]) -> Iterator[Metric]:
    """Per data-parallel rank (engine core i is rank i): ``deepinfer_dp_rank_*{rank="i"}``."""
    series = [
        ("num_requests_running", "Requests in the rank's running batch", lambda c: c.num_running),
        ("num_requests_waiting", "Requests waiting in the rank's queue", lambda c: c.num_waiting),
        (
            "kv_cache_usage_ratio",
            "Share of the rank's KV-cache blocks held by requests",
            lambda c: c.kv_cache_usage,
        ),
        (
            "expert_tokens_per_step",
            "(token, expert) pairs the rank's experts computed per step, over the EPLB window",
            lambda c: c.expert_tokens_per_step,
        ),
    ]
    for name, help_text, value in series:
        family = GaugeMetricFamily(f"deepinfer_dp_rank_{name}", help_text, labels=["rank"])
        for rank, core in sorted(cores.items()):
            if value(core) is not None:
                family.add_metric([str(rank)], value(core))
        yield family


class TokenHistogram(Collector):
    """A Prometheus histogram for values recorded per token: ``observe(value, count)`` counts
    ``value`` ``count`` times at the cost of one observation (a step's tokens at once), with no lock
    (it is only fed from the event loop's thread). Exposed like a ``prometheus_client.Histogram``
    (``_bucket`` series with ``le`` labels, ``_count``, ``_sum``)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        buckets, total = [], 0
        for bound, count in zip((*self._bounds, float("inf")), self._counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self._sum)


class ServerMetrics:
    """The server's registry and the per-request instruments."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        in_flight: Callable[[], int],
        per_core: Callable[[], dict[int, EngineStats]] = dict,
        dropped_messages: Callable[[], int] = lambda: 0,
        weight_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        """``stats``: the cores' stats summed; ``per_core``: each core's (data-parallel ranks get
        per-rank series when there are several); ``dropped_messages``: the engine client's count of
        channel frames it dropped (``EngineClient.dropped_messages``); ``weight_bytes``: the bytes of
        weights the cores hold as stored (``EngineClient.weight_bytes``)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, in_flight, per_core, dropped_messages, weight_bytes))
        r = self.registry
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "Time to first token",
            buckets=(*LATENCY_BUCKETS, 20.0, 40.0, 80.0),
            registry=r,
        )
        self.inter_token = TokenHistogram(
            "deepinfer_inter_token_latency_seconds", "Time between output tokens", LATENCY_BUCKETS, r
        )
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "deepinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "deepinfer_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            "deepinfer_requests", "Requests that ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "deepinfer_requests_rejected", "Requests refused because the queue was full", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def meter(self) -> RequestMeter:
        return RequestMeter(self)


class RequestMeter:
    """Records one request's latencies and token counts from the outputs it produced.

    The first output's arrival is the time to first token; every later token counts once in the
    inter-token-latency histogram, so its count is the tokens generated less one and its sum the time
    from the first output to the last. The tokens of one output share the time since the output
    before (a speculative step's accepted drafts, the choices of ``n`` > 1); the extra tokens of a
    first output that carries several came with the first, after no further wait (0 s)."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, for the times between outputs (monotonic)."""
        self._m = metrics
        self._clock = clock
        self._last: RequestOutput | None = None
        self._generated = 0
        self._last_time: float | None = None
        self._closed = False

    def observe(self, output: RequestOutput) -> None:
        generated = sum(len(c.token_ids) for c in output.outputs)
        new = generated - self._generated
        now = self._clock()
        if new > 0:
            if self._last_time is None:
                if output.metrics.ttft is not None:
                    self._m.ttft.observe(output.metrics.ttft)
                if new > 1:
                    self._m.inter_token.observe(0.0, new - 1)
            else:
                self._m.inter_token.observe((now - self._last_time) / new, new)
            self._last_time = now
        self._generated = generated
        self._last = output

    def close(self) -> None:
        """The request ended (finished, failed or abandoned): count it (once)."""
        if self._closed:
            return
        self._closed = True
        last = self._last
        if last is None:
            self._m.requests.labels(finish_reason="abort").inc()
            return
        self._m.prompt_tokens.inc(len(last.prompt_token_ids))
        self._m.cached_tokens.inc(last.num_cached_tokens)
        self._m.generation_tokens.inc(self._generated)
        reasons = {c.finish_reason or "abort" for c in last.outputs}
        for reason in reasons:
            self._m.requests.labels(finish_reason=reason).inc()
        m = last.metrics
        if last.finished and m.finished_time is not None:
            self._m.e2e.observe(m.finished_time - m.arrival_time)
