"""Host work per decode step does not grow with the context: counted, not timed.

Eight requests (half of them with repetition and frequency penalties) decode together with 100-token
and with 4,000-token prompts. For whole engine steps
(schedule, inputs, forward, sampling, outputs) the test counts the Python bytecodes executed (every
Python-level operation of the host path), the peak of memory allocated by Python and numpy during
the step (lists and arrays built on the host), and the block-table entries the input builder writes.
Rebuilding block-id lists, block tables or penalty tensors from every request's full history would
make them grow with the context.
"""

from __future__ import annotations

import statistics
import sys
import tracemalloc

import pytest

from deepinfer import LLM, SamplingParams

BATCH = 8
MEASURED_STEPS = 3


def _decode_step_work(context: int) -> dict[str, float]:
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
        prompt = [(7 * j + i) % 300 + 2 for j in range(context)]
        engine.add_request(f"r{i}", None, prompt, penalised if i % 2 else plain)
    while any(r.num_output_tokens < 2 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill every prompt; then all eight decode in every step
    engine.step()  # one decode step outside the measurement (first-call effects)
    table = engine.runner.inputs.block_table
    opcodes = 0

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        return count

    def count(frame, event, arg):
        nonlocal opcodes
        opcodes += event == "opcode"
        return count

    per_step: dict[str, list[float]] = {"opcodes": [], "host_bytes": [], "table_entries": []}
    tracemalloc.start()
    try:
        for _ in range(MEASURED_STEPS):
            opcodes, written = 0, table.entries_written
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            sys.settrace(trace)
            try:
                scheduled = engine.scheduler.schedule()
                assert [r.num_new_tokens for r in scheduled.requests] == [1] * BATCH
                engine.run_scheduled(scheduled)
            finally:
                sys.settrace(None)
            per_step["host_bytes"].append(tracemalloc.get_traced_memory()[1] - base)
            per_step["opcodes"].append(opcodes)
            per_step["table_entries"].append(table.entries_written - written)
    finally:
        tracemalloc.stop()
    llm.close()
    return {name: statistics.median(values) for name, values in per_step.items()}


@pytest.mark.slow  # ~25 s on two quiet cores (32k prompt tokens, then bytecode-traced steps); minutes under load
def test_decode_step_host_work_is_flat_in_the_context() -> None:
    short, long = _decode_step_work(100), _decode_step_work(4000)
    for name in ("opcodes", "host_bytes"):
        assert long[name] <= 1.2 * short[name], f"{name} per step: {short[name]} at 100, {long[name]} at 4000"
    # A decode step writes only blocks a request just got (one per request every 16 tokens at most).
    assert long["table_entries"] <= BATCH and short["table_entries"] <= BATCH, (short, long)
