"""The per-request latency histograms of ``/metrics`` (``RequestMeter``): every output token after
the first counts once in the inter-token-latency histogram."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.core.messages import EngineStats
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.server.metrics import RequestMeter, ServerMetrics


def output(token_counts: list[int], finished: bool = False) -> RequestOutput:
    """A request's cumulative state: choice i has ``token_counts[i]`` tokens."""
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[7] * n, finish_reason="stop" if finished else None)
            for i, n in enumerate(token_counts)
        ],
        finished=finished,
        metrics=RequestMetrics(
            arrival_time=0.0, first_token_time=0.5, finished_time=3.0 if finished else None
        ),
    )


def samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels or "le" not in s.labels
    }


@pytest.mark.parametrize(
    ("steps", "itl_sum"),
    [
        # a first output carrying 3 tokens (speculation accepted 2 drafts), then 1, then 2
        ([[3], [4], [6]], 1.0 + 2.0),
        # n=2: the first output carries both choices' first tokens
        ([[1, 1], [2, 2], [3, 2]], 1.0 + 2.0),
    ],
)
def test_inter_token_latency_counts_every_token_after_the_first(steps, itl_sum) -> None:
    metrics = ServerMetrics(EngineStats, lambda: 0)
    clock = iter([1.0, 2.0, 4.0])
    meter = RequestMeter(metrics, clock=lambda: next(clock))
    for i, counts in enumerate(steps):
        meter.observe(output(counts, finished=i == len(steps) - 1))
    meter.close()
    values = samples(metrics)
    generated = sum(steps[-1])
    assert values["deepinfer_generation_tokens_total"] == generated
    assert values["deepinfer_time_to_first_token_seconds_count"] == 1
    assert values["deepinfer_inter_token_latency_seconds_count"] == generated - 1
    assert values["deepinfer_inter_token_latency_seconds_sum"] == pytest.approx(itl_sum)
