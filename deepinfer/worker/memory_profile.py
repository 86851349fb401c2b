"""Profile one step at the token budget, so the KV cache is sized to leave its activations free.

The engine, sizing its KV cache from free memory, first runs the largest step its scheduler can make:
``max_num_batched_tokens`` prompt tokens spread over up to ``max_num_seqs`` fresh requests, every
request sampling a token with top-k/top-p (the sampler's sort is the step's largest temporary at a wide
vocabulary) and, with speculative decoding, drafting. It runs through a model runner built like the
engine's own, on a scratch cache just large enough for the step, and the platform measures the peak
memory it needed (``Platform.peak_memory_of``). The engine then leaves that much free when it sizes the
cache (vLLM's profile run; the step's values are discarded).

What it does not cover: prompt log-probabilities (their logits grow with the chunk, not the budget) and
captured decode graphs (they share one pool, about one decode step's intermediates: the 10% of free
memory the engine leaves unused covers them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from deepinfer.backends.cache_spec import KVCacheSpec
from deepinfer.engine.sched_output import ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.model_runner import ModelRunner

# Sampled with the sampler's heaviest path (temperature, top-k and top-p): its sort is the step's
# largest temporary at a wide vocabulary.
_SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)


def profile_shape(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiled step: the token budget spread evenly over as many requests as one
    step may hold (each at most ``max_model_len`` tokens, so a budget no step can reach is capped)."""
    requests = max(1, min(max_num_seqs, max_num_batched_tokens))
    tokens = min(max_num_batched_tokens, requests * max_model_len)
    base, extra = divmod(tokens, requests)
    return [base + (i < extra) for i in range(requests) if base + (i < extra) > 0]


def profile_step_peak(
    make_runner: Callable[[list[tuple[Tensor, ...]]], ModelRunner],
    cache_spec: KVCacheSpec,
    num_cache_layers: int,
    device: torch.device,
    vocab_size: int,
    prompt_lens: Sequence[int],
    lookahead: int,
    peak_memory_of: Callable[[Callable[[], object]], int],
) -> int:
    """Peak bytes one step of fresh prompts ``prompt_lens`` needs beyond the weights and the KV cache.

    ``make_runner(kv_caches)`` builds a runner like the engine's over the given per-layer caches;
    ``lookahead`` draft slots are kept per request; ``peak_memory_of`` is the platform's. The scratch
    cache is allocated and written before the measurement starts, so it does not count, and freed after.
    """
    bs = cache_spec.block_size
    blocks = [-(-(n + lookahead) // bs) for n in prompt_lens]
    caches = [cache_spec.allocate(sum(blocks), device) for _ in range(num_cache_layers)]
    for layer in caches:
        for tensor in layer:
            tensor.zero_()  # resident before the measurement: the scratch cache is not a step's memory
    runner = make_runner(caches)
    requests, start = [], 0
    for i, (n, k) in enumerate(zip(prompt_lens, blocks)):
        ids = [(31 * j + 7 * i) % vocab_size for j in range(n)]
        requests.append(
            ScheduledRequest(
                f"memory-profile-{i}", ids, 0, list(range(start, start + k)), True, _SAMPLED, i, n, ids, []
            )
        )
        start += k
    step = SchedulerOutput(requests)

    def run() -> None:
        runner.execute(step)
        runner.synchronize()

    return peak_memory_of(run)  # the scratch cache and the runner are freed on return
