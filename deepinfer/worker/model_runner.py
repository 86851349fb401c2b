"""Runs one scheduled step on the device: host batch -> tensors -> model -> sampled tokens.

Created by the engine from its configuration: the loaded model, its KV cache, the input builder, and
the optional parts (grammar masks, MTP drafter, captured decode graphs), all passed in; ``execute``
consumes a ``SchedulerOutput`` (host data) and returns a ``RunnerOutput`` (host data).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepinfer.engine.sched_output import ScheduledRequest, SchedulerOutput
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.structured.manager import StructuredOutputs
from deepinfer.worker.graphs import DecodeGraphs
from deepinfer.worker.inputs import InputBuilder, StepInputs
from deepinfer.worker.penalties import PenaltyState
from deepinfer.worker.sampler import SamplingRow, sample_rows, top_logprobs
from deepinfer.worker.spec_decode import MTPProposer

if TYPE_CHECKING:
    from deepinfer.engine.kv_connector import StoreConnector


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


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: Sequence[Sequence[Tensor]],
        inputs: InputBuilder,
        eos_token_ids: frozenset[int],
        synchronize: Callable[[], None],
        *,
        structured: StructuredOutputs | None = None,
        proposer: MTPProposer | None = None,
        graphs: DecodeGraphs | None = None,
        kv_connector: StoreConnector | None = None,
    ) -> None:
        """``inputs`` lays out each step's tensors; ``structured`` masks constrained requests' rows;
        ``proposer`` drafts tokens after each step (speculative decoding; it shares ``inputs``, whose
        ``decode_query_len`` must then cover its drafts); ``graphs`` replays captured decode steps;
        ``kv_connector`` saves completed blocks to the KV store after each forward."""
        if proposer is not None and inputs.decode_query_len < 1 + proposer.num_drafts:
            raise ValueError(
                f"decode_query_len={inputs.decode_query_len} cannot verify {proposer.num_drafts} drafts"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.block_size = inputs.block_size
        self.device = inputs.device
        self.eos_token_ids = eos_token_ids
        self.penalties = PenaltyState()  # penalised requests' token counts, kept across steps
        self.synchronize = synchronize  # the platform's: waits for queued device work (timing)
        self.structured = structured
        self.proposer = proposer
        self.graphs = graphs
        self.kv_connector = kv_connector

    def prepare(self, requests: Sequence[ScheduledRequest]) -> StepInputs:
        """The device tensors of a step (see ``InputBuilder.prepare``)."""
        return self.inputs.prepare(requests)

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
        hidden = self._forward(inputs)
        out = RunnerOutput()
        if plan.rows:
            self._sample_and_verify(plan, hidden, None if masks is None else masks.result(), out)
        if scheduled.decode_steps > 1:
            self._decode_further(inputs, scheduled.decode_steps, out)
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
        if scheduled.kv_saves and self.kv_connector is not None:
            self.kv_connector.save_blocks(scheduled.kv_saves)  # blocks complete after this forward
        return out

    def _forward(self, inputs: StepInputs) -> Tensor:
        """The model's final hidden states [T, D] of a step: a graph replay where one applies."""
        hidden = None
        if self.graphs is not None and self.graphs.applicable(inputs.meta, inputs.input_ids.shape[0]):
            hidden = self.graphs.forward(inputs.input_ids, inputs.positions, inputs.meta)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        return hidden

    def _decode_further(self, inputs: StepInputs, steps: int, out: RunnerOutput) -> None:
        """Iterations 2..``steps`` of a multi-iteration decode step (``Scheduler._decode_steps``):
        each computes every request's last sampled token at its next position and samples the next,
        appending to ``out``. A row is sampled exactly as in a step of its own: the tokens emitted
        earlier in this step are its history after the request's output (``SamplingRow.drafts``), so
        seeds, offsets, penalties and min_tokens see what separate steps would. Stops early once every
        request has emitted a stop token (EOS or a stop token id, past min_tokens): the scheduler
        drops tokens after a stop and rolls back the positions not computed."""
        order = inputs.order
        emitted = [out.sampled[r.request_id] for r in order]
        stopped = [self._stops(r, tokens) for r, tokens in zip(order, emitted)]
        for iteration in range(1, steps):
            if all(stopped):
                return
            step = self.inputs.advance(inputs, [tokens[-1] for tokens in emitted], iteration)
            logits = self.model.compute_logits(self._forward(step))
            rows = [
                SamplingRow(
                    r.request_id, r.sampling_params, r.seed, r.prompt_token_ids, r.output_token_ids, list(t)
                )
                for r, t in zip(order, emitted)
            ]
            result = sample_rows(logits, rows, self.eos_token_ids, self.penalties)
            for i, (r, tokens, token, logprobs) in enumerate(
                zip(order, emitted, result.token_ids, result.logprobs)
            ):
                tokens.append(token)
                stopped[i] = stopped[i] or self._stops(r, tokens[-1:], len(tokens) - 1)
                if logprobs is not None:
                    out.logprobs[r.request_id].append(logprobs)

    def _stops(self, r: ScheduledRequest, tokens: list[int], first: int = 0) -> bool:
        """Whether one of ``tokens``, emitted this step from its ``first``-th token on, ends ``r`` on a
        token (``SamplingParams.stop_reason``)."""
        emitted = len(r.output_token_ids) + first
        return any(
            r.sampling_params.stop_reason(t, self.eos_token_ids, emitted + i + 1) is not None
            for i, t in enumerate(tokens)
        )

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
                plan.rows.append(
                    SamplingRow(
                        r.request_id,
                        r.sampling_params,
                        r.seed,
                        r.prompt_token_ids,
                        r.output_token_ids,
                        drafts[:j],
                    )
                )
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
        first, count = plan.hidden_rows[0], len(plan.hidden_rows)
        if plan.hidden_rows == list(range(first, first + count)):
            picked = hidden[first : first + count]  # consecutive rows (a decode-only step): a view
        else:
            picked = hidden[torch.tensor(plan.hidden_rows, device=self.device)]
        logits = self.model.compute_logits(picked)
        result = sample_rows(logits, plan.rows, self.eos_token_ids, self.penalties, bitmask)
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
