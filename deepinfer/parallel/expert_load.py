"""Per-layer, per-expert token counts over a sliding window of steps (what EPLB balances).

Created by the data-parallel rank when expert parallelism is on; every ``MoE`` layer calls ``record``
with its routed logical expert ids (the tokens this rank routed) and ``record_received`` with the
(token, expert) pairs that reached this rank's experts; the rank calls ``advance`` once per lockstep
step that computed tokens. Host tensors (int64), a few KiB per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ExpertLoadRecorder:
    def __init__(self, layers: list[int], num_experts: int, window: int) -> None:
        """layers: the MoE layer indices (rows); window: steps kept."""
        self.rows = {layer: i for i, layer in enumerate(layers)}
        self.window = window
        rows = window + 1  # the closed steps plus the one being recorded
        self.routed = torch.zeros(rows, len(layers), num_experts, dtype=torch.int64)
        self.received = torch.zeros(rows, len(layers), dtype=torch.int64)
        self.position = 0
        self.steps = 0  # steps recorded in all (the window holds the last min(steps, window))

    def record(self, layer: int, ids: Tensor) -> None:
        """Count logical expert ids [T, k] this rank routed in ``layer`` this step."""
        if ids.numel():
            counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=self.routed.shape[2])
            self.routed[self.position, self.rows[layer]] += counts

    def record_received(self, layer: int, pairs: int) -> None:
        """(token, expert) pairs this rank's experts computed in ``layer`` this step."""
        self.received[self.position, self.rows[layer]] += pairs

    def advance(self) -> None:
        """Close the current step; the oldest step in the window is forgotten."""
        self.steps += 1
        self.position = (self.position + 1) % len(self.routed)
        self.routed[self.position].zero_()
        self.received[self.position].zero_()

    def window_load(self) -> Tensor:
        """[layers, experts] tokens routed to each logical expert over the closed steps in the window."""
        return self.routed.sum(0) - self.routed[self.position]

    def last_received(self) -> int:
        """Pairs this rank's experts computed in the last closed step, all layers together."""
        return int(self.received[(self.position - 1) % len(self.received)].sum())

    def received_per_step(self) -> float:
        """Mean pairs this rank's experts computed per closed step in the window (0 before any)."""
        closed = min(self.steps, self.window)
        if not closed:
            return 0.0
        return float(self.received.sum() - self.received[self.position].sum()) / closed
