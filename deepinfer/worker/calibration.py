"""Calibrate the step cost model on the real model: time a few synthetic steps, fit the coefficients.

Uses free KV blocks for the synthetic requests and gives them all back; the cache contents they touch
are garbage, which is irrelevant to timing. Takes a second or two on a CPU; the result is stored per
platform, chip, model and dtype so later starts load it.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path

from deepinfer import envs
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.cost_model import StepCostModel, Work
from deepinfer.engine.sched_output import ScheduledRequest, SchedulerOutput
from deepinfer.logger import get_logger
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.model_runner import ModelRunner

logger = get_logger(__name__)
_GREEDY = SamplingParams(temperature=0.0)


def cache_path(platform: str, chip: str, model_dir: Path, dtype: str) -> Path:
    key = hashlib.sha256(
        f"{StepCostModel.VERSION}|{model_dir.resolve()}|{(model_dir / 'config.json').read_bytes()!r}".encode()
    ).hexdigest()[:16]
    return (
        Path(envs.get("DEEPINFER_CACHE_DIR")).expanduser()
        / "cost_models"
        / f"{platform}-{chip}-{dtype}-{key}.json"
    )


def calibration_shapes(max_tokens: int, max_len: int) -> list[list[Work]]:
    """Prompt chunks of several sizes and contexts, and decode batches of several sizes."""
    shapes: list[list[Work]] = []
    for n in (16, 64, 256, 1024):
        for c in (0, 512, 2048, 6144):
            if n <= max_tokens and n + c < max_len:
                shapes.append([(n, c)])
    for batch in (1, 8, 32):
        for c in (128, 1024):
            if batch <= max_tokens and c < max_len:
                shapes.append([(1, c)] * batch)
    return shapes


def calibrate(
    runner: ModelRunner, pool: BlockPool, max_tokens: int, max_len: int, repeats: int = 3
) -> StepCostModel:
    block_size = runner.block_size
    vocab = runner.model.config.vocab_size
    samples = []
    for work in calibration_shapes(max_tokens, max_len):
        needed = [-(-(n + c) // block_size) for n, c in work]
        if sum(needed) > pool.num_free_blocks:
            continue
        blocks = pool.allocate(sum(needed))
        try:
            requests, start = [], 0
            for i, ((n, c), k) in enumerate(zip(work, needed)):
                ids = [(7 * j + i) % vocab for j in range(n)]
                requests.append(
                    ScheduledRequest(
                        f"calibrate-{i}", ids, c, [b.block_id for b in blocks[start : start + k]], True, _GREEDY,
                        0, n + c, ids, [],
                    )
                )  # fmt: skip
                start += k
            step = SchedulerOutput(requests)
            runner.execute(step)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.execute(step)
                runner.synchronize()
                times.append(time.perf_counter() - t0)
            samples.append((work, statistics.median(times)))
        finally:
            pool.release(blocks)
    model = StepCostModel.fit(samples)
    logger.info(
        "cost model calibrated on %d step shapes: %.2f ms + %.3f ms/request + %.4f ms/token + %.2e ms/attention "
        "pair + %.2e ms/context token of a chunk",
        len(samples),
        model.overhead_s * 1e3,
        model.per_request_s * 1e3,
        model.per_token_s * 1e3,
        model.per_attention_s * 1e3,
        model.per_context_s * 1e3,
    )
    return model
