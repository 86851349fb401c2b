"""From logits to tokens: penalties, min-tokens masking, log-probabilities, then the ``sample`` op.

Called by the model runner once per step on the rows of requests that sample. Everything runs on
the model's device; per-request parameters are gathered into small tensors once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.backends import ops
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample: the request's parameters and the token history before it."""

    sampling_params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated tokens before this row's; its length is the RNG offset


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]] | None]  # per row: (token, logprob, rank), sampled first


def _penalise(logits: Tensor, rows: list[SamplingRow]) -> None:
    """Repetition / frequency / presence penalties (vLLM semantics), in place, for rows that use them."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.sampling_params
        if not p.needs_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                r.prompt_token_ids + r.output_token_ids, dtype=torch.int64, device=logits.device
            )
            seen = seen.unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if r.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            out = torch.tensor(r.output_token_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _mask_stops_before_min_tokens(logits: Tensor, rows: list[SamplingRow], eos: frozenset[int]) -> None:
    for i, r in enumerate(rows):
        p = r.sampling_params
        if len(r.output_token_ids) < p.min_tokens:
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
    logits: Tensor, rows: list[SamplingRow], eos: frozenset[int], bitmask: Tensor | None = None
) -> SampleResult:
    """logits: [N, V] float32, one per row; ``bitmask`` [N, ceil(V/32)] int32 (structured outputs) forbids
    tokens. Returns the sampled tokens and, for requests that asked for them, log-probabilities of the
    raw (unpenalised, unmasked) distribution."""
    device = logits.device
    raw = logits
    if bitmask is not None or any(
        r.sampling_params.needs_penalties or r.sampling_params.min_tokens for r in rows
    ):
        logits = logits.clone()
        _penalise(logits, rows)
        _mask_stops_before_min_tokens(logits, rows, eos)
        if bitmask is not None:
            ops.apply_token_bitmask(logits, bitmask.to(logits.device))
    params = [r.sampling_params for r in rows]
    tokens = ops.sample(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int32, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([r.seed for r in rows], dtype=torch.int64, device=device),
        torch.tensor([len(r.output_token_ids) for r in rows], dtype=torch.int64, device=device),
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
