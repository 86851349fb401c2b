"""White-box helpers that run the real engine path (scheduler -> model runner -> model) while keeping
the logits of every computed position, for comparisons with independent implementations."""

from __future__ import annotations

import torch

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sched_output import ScheduledRequest
from deepinfer.sampling_params import SamplingParams


def greedy_steps_with_logits(
    engine: LLMEngine, batch: list[list[int]], steps: int
) -> dict[str, dict[int, torch.Tensor]]:
    """Greedy-decode ``steps`` tokens for each prompt; returns request -> position -> logits [V]."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i, ids in enumerate(batch):
        engine.add_request(f"p{i}", None, ids, params)
    logits_at: dict[str, dict[int, torch.Tensor]] = {f"p{i}": {} for i in range(len(batch))}
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        inputs = engine.runner.prepare(scheduled.requests)
        with torch.inference_mode():
            hidden = engine.model(inputs.input_ids, inputs.positions, inputs.meta, engine.kv_caches)
            logits = engine.model.compute_logits(hidden)
        sampled = {}
        for r, offset in zip(inputs.order, inputs.token_offsets):
            for j in range(r.num_new_tokens):
                logits_at[r.request_id][r.num_computed_tokens + j] = logits[offset + j]
            if r.samples:
                sampled[r.request_id] = [int(logits[offset + r.num_new_tokens - 1].argmax())]
        for request in engine.scheduler.update_from_output(scheduled, sampled):
            if request.status.finished:
                engine.outputs.finish(request)
    return logits_at


def prompt_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one prompt, computed in a single prefill."""
    return torch.stack([v for _, v in sorted(greedy_steps_with_logits(engine, [ids], 1)["p0"].items())])


def single_request(ids: list[int], block_ids: list[int], num_computed: int = 0) -> ScheduledRequest:
    """A ScheduledRequest computing ``ids`` from position ``num_computed`` in the given blocks."""
    return ScheduledRequest(
        request_id="r",
        token_ids=ids,
        num_computed_tokens=num_computed,
        block_ids=block_ids,
        samples=True,
        sampling_params=SamplingParams(temperature=0.0),
        seed=0,
        num_prompt_tokens=len(ids),
        prompt_token_ids=ids,
        output_token_ids=[],
    )
