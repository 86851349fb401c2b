"""Decode attention captured in an (emulated) ACL graph replays with the lengths given to
``AttentionLengthUpdater.update``, and refuses to be captured where its lengths would freeze."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.registry import OpTable
from deepinfer.backends.testing.checks import PagedBatch
from deepinfer.backends.testing.harness import SMALL_MLA, V3_MLA, MLAShape, generator, randn
from deepinfer.ops_ascend.graph import AttentionLengthUpdater
from deepinfer.platform.interface import DeviceGraph

CPU = torch.device("cpu")
BF16 = torch.bfloat16


class DecodeStep:
    """Static decode inputs over a filled paged cache, as a graph runner keeps them."""

    def __init__(self, ops: OpTable, shape: MLAShape, query_lens: list[int], case: str) -> None:
        gen = generator(case)
        self.ops, self.shape, self.gen = ops, shape, gen
        self.batch = PagedBatch(ops, CPU, BF16, shape, [40, 130, 77, 200], gen)
        tokens = sum(query_lens)
        self.q_nope = randn(gen, tokens, shape.heads, shape.kv_lora_rank, scale=0.1).to(BF16)
        self.q_pe = randn(gen, tokens, shape.heads, shape.rope, scale=0.1).to(BF16)
        self.seq_lens = torch.tensor([40, 130, 77, 200], dtype=torch.int32)
        self.query_start_loc = torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        )
        self.max_query_len = max(query_lens)

    def run(self, seq_lens: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        return self.ops.mla_decode(
            self.q_nope,
            self.q_pe,
            self.batch.cache,
            self.batch.block_table,
            self.seq_lens if seq_lens is None else seq_lens,
            self.query_start_loc,
            self.max_query_len,
            (self.shape.nope + self.shape.rope) ** -0.5,
            window,
        )


@pytest.mark.parametrize(
    ("shape", "query_lens"),
    [(SMALL_MLA, [1, 1, 1, 1]), (V3_MLA, [1, 3, 2, 4])],
    ids=["small-decode", "v3-multi-query"],
)
def test_replay_uses_the_updated_lengths(ascend_ops: OpTable, shape: MLAShape, query_lens: list[int]) -> None:
    step = DecodeStep(ascend_ops, shape, query_lens, f"graph-{shape.name}")
    graph = DeviceGraph(torch.npu, torch.npu.NPUGraph)
    updater = AttentionLengthUpdater()
    with updater.recording():
        out = graph.capture(step.run)
    assert updater.num_calls == 1

    new_lens = [33, 129, 12, 150]
    step.seq_lens.copy_(torch.tensor(new_lens))
    step.q_nope.copy_(randn(step.gen, *step.q_nope.shape, scale=0.1))
    updater.update(new_lens, step.query_start_loc.tolist())
    graph.replay()
    assert torch.equal(out, step.run(torch.tensor(new_lens, dtype=torch.int32)))


def test_replay_without_update_keeps_the_captured_lengths(ascend_ops: OpTable) -> None:
    """What the update is for: the host lengths are part of the captured task."""
    step = DecodeStep(ascend_ops, SMALL_MLA, [1, 1, 1, 1], "graph-stale")
    graph = DeviceGraph(torch.npu, torch.npu.NPUGraph)
    with AttentionLengthUpdater().recording():
        out = graph.capture(step.run)
    captured = out.clone()
    step.seq_lens.copy_(torch.tensor([33, 129, 12, 150]))
    graph.replay()
    assert torch.equal(out, captured)


def test_an_update_must_keep_the_captured_mask_mode(ascend_ops: OpTable) -> None:
    step = DecodeStep(ascend_ops, SMALL_MLA, [1, 1, 1, 1], "graph-mode")
    graph = DeviceGraph(torch.npu, torch.npu.NPUGraph)
    updater = AttentionLengthUpdater()
    with updater.recording():
        graph.capture(step.run)
    with pytest.raises(ValueError, match="captured with one query token per request"):
        updater.update([40, 130, 77, 200], [0, 1, 3, 4, 5])


def test_capture_outside_recording_is_refused(ascend_ops: OpTable) -> None:
    step = DecodeStep(ascend_ops, SMALL_MLA, [1, 1, 1, 1], "graph-unrecorded")
    with pytest.raises(RuntimeError, match=r"outside AttentionLengthUpdater.recording\(\)"):
        DeviceGraph(torch.npu, torch.npu.NPUGraph).capture(step.run)


def test_windowed_decode_is_not_captured(ascend_ops: OpTable) -> None:
    step = DecodeStep(ascend_ops, SMALL_MLA, [1, 1, 1, 1], "graph-window")
    with AttentionLengthUpdater().recording(), pytest.raises(RuntimeError, match="not graph-capturable"):
        DeviceGraph(torch.npu, torch.npu.NPUGraph).capture(lambda: step.run(window=24))


def test_one_recorder_at_a_time(npu_emulation: None) -> None:
    first = AttentionLengthUpdater()
    with (
        first.recording(),
        pytest.raises(RuntimeError, match="already recording"),
        AttentionLengthUpdater().recording(),
    ):
        pass
