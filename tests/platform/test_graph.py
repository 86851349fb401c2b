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
