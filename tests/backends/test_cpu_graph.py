"""CPU graphs (deepinfer.backends.cpu.graph): a replay computes what running the function again would,
into the captured outputs, for the kinds of calls a model step makes; what a replay could not reproduce
is refused at capture, naming the op; intermediates are not kept between replays."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu.graph import CpuGraph, GraphCaptureError
from deepinfer.backends.cpu.native import load
from deepinfer.platform.interface import EagerGraph
from deepinfer.platform.registry import resolve_platform

pytestmark = pytest.mark.usefixtures("inference")


@pytest.fixture
def inference():
    with torch.inference_mode():
        yield


def _capture_and_check(fn, inputs: list[torch.Tensor], steps: int = 3) -> CpuGraph:
    """Capture fn, then refresh the inputs in place several times: each replay equals a fresh eager call,
    bit for bit, and lands in the tensors capture returned."""
    graph = CpuGraph()
    outputs = graph.capture(fn)
    captured = [o for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for t in inputs:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        graph.replay()
        expected = fn()
        expected = expected if isinstance(expected, (tuple, list)) else (expected,)
        for got, want in zip(captured, expected):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
    return graph


def test_replay_matches_eager_for_views_lists_scalars_and_in_place_ops() -> None:
    x, w = torch.randn(6, 8), torch.randn(4, 8)
    buf = torch.zeros(6, 4)
    idx = torch.tensor([5, 0, 2])

    def step():
        y = torch.nn.functional.linear(x, w)  # [6, 4]
        a, b = y.split([2, 2], dim=-1)
        z = torch.cat([a * 2.5, b.softmax(-1) + 1], dim=-1)
        buf.copy_(z)  # in place on a tensor made before capture
        picked = z[idx]  # an index with a tensor made before capture (Tensor?[] list)
        return z.t().contiguous(), picked.sum(0), buf.clone()

    graph = _capture_and_check(step, [x, w])
    assert graph.num_ops > 8


def test_python_numbers_keep_tensor_dtypes() -> None:
    """``x + 1`` records a Python number where the op takes a Tensor: the replay must promote it as a
    scalar (bf16 stays bf16; an int tensor times a float becomes float32, not float64)."""
    x = torch.randn(5).to(torch.bfloat16)
    n = torch.arange(5)
    _capture_and_check(lambda: (x + 1, x * 0.5, n * 1.5, n + 2), [x])


def test_native_ops_and_tensor_lists() -> None:
    ops = load()
    x, weight = torch.randn(3, 16), torch.randn(16)
    res = torch.randn(3, 16)

    def step():
        normed, summed = ops.add_rms_norm(x, res, weight, 1e-6)
        return torch.stack([ops.rms_norm(normed, weight, 1e-6), summed])

    _capture_and_check(step, [x, res])


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda x: x * x.sum().item(), "item"),
        (lambda x: x[: int(x.argmax())], "item|_local_scalar_dense"),
        (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), "lift_fresh"),
        (lambda x: x + torch.rand(4), "rand"),
        (lambda x: torch.nn.functional.dropout(x, 0.5, training=True), "bernoulli|dropout"),
    ],
    ids=["item", "data-dependent-shape", "host-data", "random", "dropout"],
)
def test_what_a_replay_cannot_reproduce_is_refused(fn, match: str) -> None:
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match=match):
        CpuGraph().capture(lambda: fn(x))


def test_outputs_must_be_tensors_produced_inside() -> None:
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match="return tensors"):
        CpuGraph().capture(lambda: (x + 1, 3))
    with pytest.raises(GraphCaptureError, match="no recorded op produced"):
        CpuGraph().capture(lambda: x)


def test_replay_before_capture_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="before capture"):
        CpuGraph().replay()


def test_a_failing_op_raises_and_leaves_the_graph_usable() -> None:
    """An op that fails at replay (here: a slot index out of range read by a native kernel) raises a
    RuntimeError naming it; the graph drops that replay's intermediates and replays again once the
    input is valid."""
    ops = load()
    cache = torch.zeros(4, 2, 6)
    slots = torch.tensor([1, 2])
    kv_c, k_pe = torch.randn(2, 4), torch.randn(2, 2)
    graph = CpuGraph()
    graph.capture(lambda: (ops.kv_cache_write(kv_c, k_pe, cache, slots), cache.sum(1))[1])
    slots.copy_(torch.tensor([1, 99]))
    with pytest.raises(RuntimeError, match="out of range"):
        graph.replay()
    slots.copy_(torch.tensor([3, 4]))
    graph.replay()
    assert torch.equal(cache.view(8, 6)[4, :4], kv_c[1])
    assert graph._graph.held == 0


def _peak_bytes(fn) -> int:
    """Most bytes allocated at once while fn runs, from the profiler's allocation and free events."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.cpu_memory_usage
        peak = max(peak, current)
    return peak


def test_intermediates_are_freed_after_their_last_reader() -> None:
    """A replay frees each temporary once its last reader has run (a chain of ten 4 MiB temporaries
    never holds more than two of them, as the eager run would) and holds none between replays."""
    x = torch.randn(1024, 1024)

    def step():
        y = x
        for i in range(10):
            y = y * (1.0 + i)
        return y.sum(0)

    graph = CpuGraph()
    graph.capture(step)
    mib = 1 << 20
    assert _peak_bytes(graph.replay) < 9 * mib
    assert graph._graph.held == 0


def test_the_cpu_platform_gives_cpu_graphs_with_the_fast_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = resolve_platform("cpu")
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "fast")
    assert isinstance(platform.graph(), CpuGraph) and platform.graph_capture_default
    assert platform.graph_batch_sizes(5) == [1, 2, 3, 4, 5]
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "reference")
    assert isinstance(platform.graph(), EagerGraph) and not platform.graph_capture_default
