"""The graph-capture wrapper contract, exercised through the eager implementation (what platforms
without graphs, and the cpu platform under the reference backend, use)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.platform.interface import EagerGraph


def test_replay_recomputes_into_the_captured_outputs() -> None:
    graph = EagerGraph()
    x = torch.arange(4.0)
    weight = torch.full((4,), 2.0)
    out = graph.capture(lambda: {"y": x * weight, "pair": (x + 1, x.sum())})
    y, pair = out["y"], out["pair"]
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    graph.replay()
    assert out["y"] is y and torch.equal(y, torch.tensor([20.0, 40.0, 60.0, 80.0]))
    assert torch.equal(pair[0], torch.tensor([11.0, 21.0, 31.0, 41.0])) and pair[1].item() == 100.0


def test_replay_before_capture_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="before capture"):
        EagerGraph().replay()


def test_device_graphs_capture_into_the_pool_they_were_given() -> None:
    """DeviceGraph over a stand-in for ``torch.cuda``: a warm-up run on a side stream, then the capture
    into ``graph(g, pool=...)`` with the engine's shared pool."""
    from contextlib import contextmanager

    from deepinfer.platform.interface import DeviceGraph

    calls = []

    class FakeStream:
        def wait_stream(self, other: object) -> None:
            calls.append("wait")

    class FakeDevice:
        Stream = FakeStream

        @staticmethod
        def current_stream() -> FakeStream:
            return FakeStream()

        @staticmethod
        @contextmanager
        def stream(s: FakeStream):
            calls.append("side")
            yield

        @staticmethod
        @contextmanager
        def graph(g: object, pool: object = None):
            calls.append(("capture", pool))
            yield

    pool = object()
    graph = DeviceGraph(FakeDevice, object, pool)
    out = graph.capture(lambda: torch.ones(2))
    assert torch.equal(out, torch.ones(2))
    assert ("capture", pool) in calls and calls.index("side") < calls.index(("capture", pool))
