"""The torch.distributed pieces every backend's expert-parallel ops share (gloo, nccl, hccl alike)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor


def world_size(group: Any | None) -> int:
    """Ranks in ``group``; 1 without one (expert parallelism off)."""
    return 1 if group is None else dist.get_world_size(group)


def all_to_all(payload: Tensor, send_splits: list[int], recv_splits: list[int], group: Any) -> Tensor:
    """Send ``send_splits[r]`` rows of ``payload`` to rank r; returns the ``sum(recv_splits)`` rows
    received, ordered by source rank. Collective."""
    out = payload.new_empty((sum(recv_splits), *payload.shape[1:]))
    dist.all_to_all_single(out, payload.contiguous(), recv_splits, send_splits, group=group)
    return out
