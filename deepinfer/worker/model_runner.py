"""Runs one scheduled step on the device: host batch -> tensors -> model -> sampled tokens.

Created by the engine with the loaded model and its KV cache; ``execute`` consumes a
``SchedulerOutput`` (host data) and returns a ``RunnerOutput`` (host data). Tokens are laid out decode
requests first (few new tokens: absorbed attention over the paged cache), then prefill chunks
(expanded attention), which is the order ``AttentionMetadata`` promises the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from deepinfer.engine.sched_output import ScheduledRequest, SchedulerOutput
from deepinfer.model.attn_metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.worker.sampler import SamplingRow, sample_rows, top_logprobs

if TYPE_CHECKING:
    from deepinfer.structured.manager import StructuredOutputs
    from deepinfer.worker.graphs import DecodeGraphs
    from deepinfer.worker.spec_decode import MTPProposer


@dataclass(slots=True)
class RunnerOutput:
    # request id -> the tokens this step emits: accepted drafts, then one sampled token
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> per emitted token, (token, logprob, rank) entries (sampled token first)
    logprobs: dict[str, list[list[tuple[int, float, int]]]] = field(default_factory=dict)
    # request id -> [(prompt position, entries)] for prompt tokens in this chunk
    prompt_logprobs: dict[str, list[tuple[int, list[tuple[int, float, int]]]]] = field(default_factory=dict)
    # request id -> draft tokens to verify next step (speculative decoding)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    num_proposed: int = 0  # draft tokens the drafter produced this step
    num_verified: int = 0  # draft tokens checked against the target this step
    num_accepted: int = 0  # of which accepted
    seconds: float = 0.0  # wall time of the step, host and device, until its tokens were on the host


@dataclass(slots=True)
class SamplingPlan:
    """The rows a step samples: per request (its first row, its drafts), per row the hidden-state
    index and the sampling parameters and history."""

    spans: list[tuple[ScheduledRequest, int, list[int]]]
    hidden_rows: list[int]
    rows: list[SamplingRow]


@dataclass(slots=True)
class StepInputs:
    """The device tensors of one step and where each request's tokens sit in them."""

    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    order: list[ScheduledRequest]
    token_offsets: list[int]  # first token index of each request in ``order``


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: Sequence[Sequence[Tensor]],
        block_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int],
        synchronize: Callable[[], None],
        decode_query_len: int = 1,
    ) -> None:
        """``decode_query_len``: requests computing at most this many tokens (one plus their drafts)
        take the absorbed decode path. ``proposer`` (set by the engine) drafts tokens after each step."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.decode_query_len = decode_query_len
        self.synchronize = synchronize  # the platform's: waits for queued device work (timing)
        self.proposer: MTPProposer | None = None
        self.structured: StructuredOutputs | None = None
        self.graphs: DecodeGraphs | None = None

    # ------------------------------------------------------------------ inputs
    def prepare(self, requests: Sequence[ScheduledRequest]) -> StepInputs:
        decode = [r for r in requests if r.num_new_tokens <= self.decode_query_len]
        prefill = [r for r in requests if r.num_new_tokens > self.decode_query_len]
        order = decode + prefill
        bs = self.block_size
        query_lens = np.array([r.num_new_tokens for r in order], dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r in order], dtype=np.int64)
        seq_lens = starts + query_lens
        offsets = np.concatenate(([0], np.cumsum(query_lens)))
        width = max(len(r.block_ids) for r in order)
        table = np.zeros((len(order), width), dtype=np.int64)
        for i, r in enumerate(order):
            table[i, : len(r.block_ids)] = r.block_ids

        req_of_token = np.repeat(np.arange(len(order)), query_lens)
        positions = starts[req_of_token] + (np.arange(offsets[-1]) - offsets[req_of_token])
        slots = table[req_of_token, positions // bs] * bs + positions % bs
        input_ids = np.fromiter(
            (t for r in order for t in r.token_ids), dtype=np.int64, count=int(offsets[-1])
        )

        dev = self.device
        decode_meta = prefill_meta = None
        num_decode = len(decode)
        if decode:
            decode_meta = DecodeMetadata(
                num_tokens=int(offsets[num_decode]),
                block_table=torch.from_numpy(table[:num_decode].astype(np.int32)).to(dev),
                seq_lens=torch.from_numpy(seq_lens[:num_decode].astype(np.int32)).to(dev),
                query_start_loc=torch.from_numpy(offsets[: num_decode + 1].astype(np.int32)).to(dev),
                max_query_len=int(query_lens[:num_decode].max()),
            )
        if prefill:
            p_q, p_k = query_lens[num_decode:], seq_lens[num_decode:]
            context_slots = None
            if (starts[num_decode:] > 0).any():
                context_slots = np.concatenate(
                    [
                        table[i, np.arange(n) // bs] * bs + np.arange(n) % bs
                        for i, n in enumerate(p_k, num_decode)
                    ]
                )
                context_slots = torch.from_numpy(context_slots).to(dev)
            prefill_meta = PrefillMetadata(
                cu_seqlens_q=torch.from_numpy(np.concatenate(([0], np.cumsum(p_q))).astype(np.int32)).to(dev),
                cu_seqlens_k=torch.from_numpy(np.concatenate(([0], np.cumsum(p_k))).astype(np.int32)).to(dev),
                max_seqlen_q=int(p_q.max()),
                max_seqlen_k=int(p_k.max()),
                context_slots=context_slots,
            )
        meta = AttentionMetadata(torch.from_numpy(slots).to(dev), decode_meta, prefill_meta)
        return StepInputs(
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            meta,
            order,
            offsets[:-1].tolist(),
        )

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        inputs = self.prepare(scheduled.requests)
        plan = self._sampling_plan(inputs)
        masks = None
        if self.structured is not None and plan.rows:
            masks = self.structured.start_masks(
                [(r.request_id, first, drafts) for r, first, drafts in plan.spans], len(plan.rows)
            )
        if self.graphs is not None and self.graphs.applicable(inputs.meta, inputs.input_ids.shape[0]):
            hidden = self.graphs.forward(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        out = RunnerOutput()
        if plan.rows:
            self._sample_and_verify(plan, hidden, None if masks is None else masks.result(), out)
        for i, r in enumerate(inputs.order):
            k = r.sampling_params.prompt_logprobs
            if k is not None and r.num_computed_tokens < r.num_prompt_tokens - 1:
                out.prompt_logprobs[r.request_id] = self._prompt_logprobs(
                    hidden, inputs.token_offsets[i], r, k
                )
        if self.proposer is not None and out.sampled:
            out.drafts, out.num_proposed = self.proposer.propose(inputs, hidden, out.sampled)
            if self.structured is not None:
                out.drafts = {
                    rid: self.structured.valid_drafts(rid, out.sampled[rid], drafts)
                    for rid, drafts in out.drafts.items()
                }
        return out

    def _sampling_plan(self, inputs: StepInputs) -> SamplingPlan:
        """One sampled row at each request's last real position and one at each of its drafts."""
        plan = SamplingPlan([], [], [])
        for i, r in enumerate(inputs.order):
            if not r.samples:
                continue
            drafts = r.token_ids[r.num_new_tokens - r.num_draft_tokens :]
            first = inputs.token_offsets[i] + r.num_new_tokens - 1 - r.num_draft_tokens
            plan.spans.append((r, len(plan.rows), drafts))
            for j in range(len(drafts) + 1):
                plan.hidden_rows.append(first + j)
                history = r.output_token_ids + drafts[:j] if j else r.output_token_ids
                plan.rows.append(SamplingRow(r.sampling_params, r.seed, r.prompt_token_ids, history))
        return plan

    def _sample_and_verify(
        self, plan: SamplingPlan, hidden: Tensor, bitmask: Tensor | None, out: RunnerOutput
    ) -> None:
        """Sample every planned row; accept each request's drafts while they equal the sampled tokens.

        The token sampled at a position is exactly the one non-speculative decoding would sample there
        (same seed, same offset, same history, same grammar state), so accepting drafts while they equal
        the sampled tokens keeps the output identical, greedy or not; the first mismatch is the
        request's new token.
        """
        logits = self.model.compute_logits(hidden[torch.tensor(plan.hidden_rows, device=self.device)])
        result = sample_rows(logits, plan.rows, self.eos_token_ids, bitmask)
        for r, start, drafts in plan.spans:
            tokens = result.token_ids[start : start + len(drafts) + 1]
            accepted = 0
            while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
                accepted += 1
            out.sampled[r.request_id] = tokens[: accepted + 1]
            if r.sampling_params.logprobs is not None:
                out.logprobs[r.request_id] = result.logprobs[start : start + accepted + 1]
            out.num_verified += len(drafts)
            out.num_accepted += accepted
            if self.proposer is not None:
                self.proposer.record_verification(r.request_id, len(drafts), accepted)

    def _prompt_logprobs(
        self, hidden: Tensor, offset: int, r: ScheduledRequest, k: int
    ) -> list[tuple[int, list[tuple[int, float, int]]]]:
        """Log-probabilities of prompt tokens start+1 .. end of this chunk (from the logits before them)."""
        start = r.num_computed_tokens
        end = min(start + r.num_new_tokens, r.num_prompt_tokens - 1)
        logits = self.model.compute_logits(hidden[offset : offset + end - start])
        targets = torch.tensor(r.prompt_token_ids[start + 1 : end + 1], device=self.device)
        entries = top_logprobs(logits, targets, k)
        return [(start + 1 + j, entry) for j, entry in enumerate(entries)]
