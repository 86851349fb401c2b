"""From logits to tokens: penalties, min-tokens masking, log-probabilities, then the ``sample`` op.

Called by the model runner once per step on the rows of requests that sample. Everything runs on
the model's device; per-request parameters are gathered into small tensors once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from deepinfer.backends import ops
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.penalties import PenaltyState


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample: the request's parameters and the token history before it, which is
    the request's output so far and then ``drafts`` (its speculative tokens ahead of this row)."""

    request_id: str
    sampling_params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the request's own output list (the scheduler's, which only grows)
    drafts: list[int] = field(default_factory=list)

    @property
    def offset(self) -> int:
        """Generated tokens before this row's: its RNG offset and min_tokens count."""
        return len(self.output_token_ids) + len(self.drafts)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]] | None]  # per row: (token, logprob, rank), sampled first


def _penalise(logits: Tensor, rows: list[SamplingRow], state: PenaltyState) -> None:
    """Repetition / frequency / presence penalties (vLLM semantics), in place, for rows that use them:
    repetition over the prompt and output tokens, frequency and presence over the output tokens."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.sampling_params
        if not p.needs_penalties:
            continue
        seen, counts = state.history(
            r.request_id, r.prompt_token_ids, r.output_token_ids, r.drafts, vocab, logits.device
        )
        row = logits[i]
        if p.repetition_penalty != 1.0:
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if r.offset and (p.frequency_penalty or p.presence_penalty):
            c = counts.to(row.dtype)
            row -= p.frequency_penalty * c + p.presence_penalty * (c > 0).to(row.dtype)


def _mask_stops_before_min_tokens(logits: Tensor, rows: list[SamplingRow], eos: frozenset[int]) -> None:
    for i, r in enumerate(rows):
        p = r.sampling_params
        if r.offset < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            if banned:
                logits[i, list(banned)] = float("-inf")


def top_logprobs(logits: Tensor, chosen: Tensor, k: int) -> list[list[tuple[int, float, int]]]:
    """Per row: the chosen token's (id, logprob, rank) followed by the k most likely tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1)
    ranks = (logp > chosen_lp[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = logp.topk(k, dim=-1)
    out = []
    for i, (token, lp, rank) in enumerate(zip(chosen.tolist(), chosen_lp.tolist(), ranks.tolist())):
        entry = [(token, lp, rank)]
        entry += [(t, v, j + 1) for j, (t, v) in enumerate(zip(top_ids[i].tolist(), top_lp[i].tolist()))]
        out.append(entry)
    return out


def sample_rows(
    logits: Tensor,
    rows: list[SamplingRow],
    eos: frozenset[int],
    penalties: PenaltyState,
    bitmask: Tensor | None = None,
) -> SampleResult:
    """logits: [N, V] float32, one per row; ``penalties`` holds the penalised requests' token counts
    across steps; ``bitmask`` [N, ceil(V/32)] int32 (structured outputs) forbids tokens. Returns the sampled tokens and, for requests that asked for them, log-probabilities of the
    raw (unpenalised, unmasked) distribution."""
    device = logits.device
    raw = logits
    penalties.retain(r.request_id for r in rows if r.sampling_params.needs_penalties)
    if bitmask is not None or any(
        r.sampling_params.needs_penalties or r.sampling_params.min_tokens for r in rows
    ):
        logits = logits.clone()
        _penalise(logits, rows, penalties)
        _mask_stops_before_min_tokens(logits, rows, eos)
        if bitmask is not None:
            ops.apply_token_bitmask(logits, bitmask.to(logits.device))
    params = [r.sampling_params for r in rows]
    if all(p.greedy for p in params):
        # Every row greedy: the sample op's result (temperature 0 is argmax, the filters ignored),
        # without building its six per-row parameter tensors.
        tokens = ops.greedy(logits)
    else:
        tokens = ops.sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([r.seed for r in rows], dtype=torch.int64, device=device),
            torch.tensor([r.offset for r in rows], dtype=torch.int64, device=device),
        )
    logprobs: list[list[tuple[int, float, int]] | None] = [None] * len(rows)
    wanting = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanting:
        k = max(params[i].logprobs or 0 for i in wanting)
        index = torch.tensor(wanting, device=device)
        entries = top_logprobs(raw.index_select(0, index), tokens.index_select(0, index), k)
        for i, entry in zip(wanting, entries):
            logprobs[i] = entry[: 1 + (params[i].logprobs or 0)]
    return SampleResult(tokens.tolist(), logprobs)


def to_logprob_dict(entry: list[tuple[int, float, int]], decode: Callable[[int], str]) -> dict[int, Logprob]:
    """(token, logprob, rank) triples -> {token: Logprob}; the sampled token comes first."""
    out: dict[int, Logprob] = {}
    for token, lp, rank in entry:
        out.setdefault(token, Logprob(lp, rank, decode(token)))
    return out
