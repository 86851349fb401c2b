"""Host work per decode step does not grow with the context: counted, not timed.

Eight requests decode together with 100-token and with 4,000-token prompts. Per decode step the tests
count (``tests.engine.host_work``) the Python bytecodes executed, the peak of memory Python and numpy
allocate, the elements of new tensors torch ops make, and the block-table entries the input builder
writes or copies. Rebuilding block-id lists, block tables, slot lists or penalty tensors from every
request's full history, or copying whole token lists, would make one of them grow with the context.

The first test runs the scheduler, the KV-cache manager and the input builder without a model (a
fraction of a second); the second runs whole engine steps (sampling with penalties, outputs too),
leaving the model's forward pass (device work) uncounted.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.worker.inputs import InputBuilder
from tests.engine.host_work import HostWork

BATCH = 8
MEASURED_STEPS = 3  # fewer than a block's 16 tokens: at most one of them allocates new blocks
BLOCK_SIZE = 16


def _prompt(i: int, context: int) -> list[int]:
    return [(7 * j + i) % 300 + 2 for j in range(context)]


def _assert_flat(short: dict[str, float], long: dict[str, float]) -> None:
    for name in ("opcodes", "host_bytes", "torch_elements"):
        assert long[name] <= 1.2 * short[name], f"{name} per step: {short[name]} at 100, {long[name]} at 4000"
    # A decode step writes (and copies into the step's table) only blocks a request just got: one per
    # request every 16 tokens at most.
    assert long["table_entries"] <= 2 * BATCH and short["table_entries"] <= 2 * BATCH, (short, long)


def _scheduled_step_work(context: int) -> dict[str, float]:
    config = SchedulerConfig(BATCH, 8192, 4200, 8192)
    scheduler = Scheduler(config, KVCacheManager(BATCH * 270 + 8, BLOCK_SIZE, True))
    builder = InputBuilder(BLOCK_SIZE, torch.device("cpu"))
    table = builder.block_table
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(BATCH):
        scheduler.add_request(Request(f"r{i}", _prompt(i, context), params, i, 64, frozenset({0}), 0.0))

    def step(token: int) -> list[int]:
        out = scheduler.schedule()
        builder.prepare(out.requests)
        scheduler.update_from_output(out, {r.request_id: [token] for r in out.requests if r.samples})
        return [r.num_new_tokens for r in out.requests]

    while any(r.num_output_tokens < 2 for r in scheduler.requests.values()):
        step(5)  # prefill every prompt; then all eight decode in every step
    step(6)  # one decode step outside the measurement (first-call effects)
    per_step: dict[str, list[float]] = {"table_entries": []}
    for k in range(MEASURED_STEPS):
        entries = table.entries_written + table.entries_copied
        with HostWork() as work:
            assert step(7 + k) == [1] * BATCH
        for name, value in work.as_dict().items():
            per_step.setdefault(name, []).append(value)
        per_step["table_entries"].append(table.entries_written + table.entries_copied - entries)
    return {name: statistics.median(values) for name, values in per_step.items()}


def test_scheduled_decode_step_host_work_is_flat_in_the_context() -> None:
    _assert_flat(_scheduled_step_work(100), _scheduled_step_work(4000))


def _engine_step_work(context: int) -> dict[str, float]:
    llm = LLM(
        None, max_model_len=4200, max_num_batched_tokens=8192, num_kv_blocks=BATCH * 270 + 8,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, repetition_penalty=1.1, frequency_penalty=0.2
    )
    for i in range(BATCH):
        engine.add_request(f"r{i}", None, _prompt(i, context), penalised if i % 2 else plain)
    while any(r.num_output_tokens < 2 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill every prompt; then all eight decode in every step
    engine.step()  # one decode step outside the measurement (first-call effects)
    table = engine.runner.inputs.block_table
    model = engine.runner.model
    forward = model.forward
    per_step: dict[str, list[float]] = {"table_entries": []}
    for _ in range(MEASURED_STEPS):
        entries = table.entries_written + table.entries_copied
        with HostWork() as work:

            def uncounted_forward(*args, **kwargs):  # the forward pass is device work
                with work.paused():
                    return forward(*args, **kwargs)

            model.forward = uncounted_forward
            try:
                scheduled = engine.scheduler.schedule()
                assert [r.num_new_tokens for r in scheduled.requests] == [1] * BATCH
                engine.run_scheduled(scheduled)
            finally:
                del model.forward
        for name, value in work.as_dict().items():
            per_step.setdefault(name, []).append(value)
        per_step["table_entries"].append(table.entries_written + table.entries_copied - entries)
    llm.close()
    return {name: statistics.median(values) for name, values in per_step.items()}


@pytest.mark.slow  # ~20 s on two cores (32k prompt tokens, then bytecode-traced steps); minutes under load
def test_decode_step_host_work_is_flat_in_the_context() -> None:
    _assert_flat(_engine_step_work(100), _engine_step_work(4000))
