"""The front's per-token fast paths give what the general paths give: pre-rendered stream events
are byte for byte the events the models make, and a per-step histogram exposes what a Prometheus
histogram fed per token would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deepinfer.server.api.chat import ChatRenderer
from deepinfer.server.api.completions import CompletionRenderer
from deepinfer.server.metrics import LATENCY_BUCKETS, TokenHistogram
from deepinfer.server.protocol import chat as pc
from deepinfer.server.protocol import completions as pcomp
from deepinfer.web.sse import EventTemplate, sse

TEXTS = [
    "",
    "def f(x):\n\treturn x",
    'quote " backslash \\ slash /',
    "control \x00\x01\x1f\x7f",
    "unicode é ß 中文 🙂 \u2028\u2029",
    "</script>{}[],:",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("event", [None, "delta"])
def test_template_renders_what_sse_renders(text: str, event: str | None) -> None:
    def data(t: str) -> dict:
        return {"id": "x", "choices": [{"index": 0, "text": t, "finish_reason": None}], "n": 1.5}

    assert EventTemplate(data, event).render(text) == sse(data(text), event)


def test_template_needs_the_string_exactly_once() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        EventTemplate(lambda t: {"a": t, "b": t})
    with pytest.raises(ValueError, match="exactly once"):
        EventTemplate(lambda t: {"a": "constant"})


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_chunk_is_the_model_chunk(text: str) -> None:
    renderer = CompletionRenderer([], 'm"odel', 2, None, None, False)
    for index in (0, 1):
        expected = renderer._chunk([pcomp.CompletionChoice(index=index, text=text, finish_reason=None)])
        assert renderer._text_chunk(index, text) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("field", ["content", "reasoning_content"])
def test_chat_text_chunk_is_the_model_chunk(text: str, field: str) -> None:
    renderer = ChatRenderer(None, "model/ü", 2, None, False)
    for index in (0, 1):
        choice = pc.ChunkChoice(index=index, delta=pc.Delta(**{field: text}))
        assert renderer._text_chunk(index, field, text) == renderer._chunk([choice])


def test_token_histogram_exposes_what_a_prometheus_histogram_does() -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("gap_seconds", "doc", buckets=LATENCY_BUCKETS, registry=reference)
    tokens = TokenHistogram("gap_seconds", "doc", LATENCY_BUCKETS, ours)
    for value, count in [(0.001, 2), (0.0011, 1), (0.3, 3), (20.0, 1), (0.0, 1), (0.05, 0)]:
        tokens.observe(value, count)
        for _ in range(count):
            histogram.observe(value)
    expected = [line for line in generate_latest(reference).splitlines() if b"_created" not in line]
    assert generate_latest(ours).splitlines() == expected
