"""Penalty state kept across steps: per request, which tokens its prompt and output hold and how
often its output holds each, updated with the new tokens only.

Owned by the model runner and read by the sampler (``sample_rows``) for requests with repetition,
frequency or presence penalties. Lives on the logits' device: a [V] bool mask and a [V] int32 count
per request. An entry is tied to the request's own prompt and output lists (``ScheduledRequest``
passes the scheduler's lists, which only grow): while the same lists come back, only output tokens
not yet folded in are added; other lists (a new request reusing an id, a caller passing copies)
rebuild it. Entries of requests absent from a step are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class _Entry:
    prompt: list[int]
    output: list[int]
    folded: int  # output tokens counted so far
    seen: Tensor  # [V] bool: in the prompt or the output
    counts: Tensor  # [V] int32: occurrences in the output


class PenaltyState:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def retain(self, request_ids: Iterable[str]) -> None:
        """Drop the entries of requests not in ``request_ids`` (this step's penalised requests)."""
        keep = set(request_ids)
        for rid in [rid for rid in self._entries if rid not in keep]:
            del self._entries[rid]

    def history(
        self, request_id: str, prompt: list[int], output: list[int], drafts: list[int], vocab: int, device
    ) -> tuple[Tensor, Tensor]:
        """(seen [V] bool, counts [V] int32) for a row whose history is ``prompt``, ``output`` and then
        ``drafts`` (speculative tokens ahead of the row; counted for this row only). The tensors are
        the state itself when there are no drafts: callers must not modify them."""
        entry = self._entries.get(request_id)
        if (
            entry is None
            or entry.prompt is not prompt
            or entry.output is not output
            or entry.folded > len(output)
        ):
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
            counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            entry = self._entries[request_id] = _Entry(prompt, output, 0, seen, counts)
        if len(output) > entry.folded:
            _fold(entry.seen, entry.counts, output[entry.folded :])
            entry.folded = len(output)
        if not drafts:
            return entry.seen, entry.counts
        seen, counts = entry.seen.clone(), entry.counts.clone()
        _fold(seen, counts, drafts)
        return seen, counts


def _fold(seen: Tensor, counts: Tensor, tokens: list[int]) -> None:
    ids = torch.tensor(tokens, dtype=torch.int64, device=seen.device)
    seen[ids] = True
    counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
