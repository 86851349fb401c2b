"""The host copy of a metadata tensor is made once per tensor and version and never outlives either."""

from __future__ import annotations

import torch

from deepinfer.ops_ascend import host
from deepinfer.ops_ascend.host import host_list


def test_one_copy_per_tensor_and_version(monkeypatch) -> None:
    t = torch.tensor([0, 3, 7], dtype=torch.int32)
    copies = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: copies.append(1) or real(self))
    assert host_list(t) == [0, 3, 7]
    assert host_list(t) == [0, 3, 7]
    assert len(copies) == 1
    t.copy_(torch.tensor([0, 4, 9]))
    assert host_list(t) == [0, 4, 9]
    assert len(copies) == 2


def test_a_new_tensor_never_reuses_a_dead_entry() -> None:
    for step in range(3 * host._MAX_ENTRIES):
        assert host_list(torch.tensor([step, step + 1])) == [step, step + 1]
    assert len(host._cache) <= host._MAX_ENTRIES
