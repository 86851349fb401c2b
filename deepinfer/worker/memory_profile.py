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

The weights count as they are stored: free memory is read after the model is loaded, so FP8 / MXFP4
weights kept as-stored (values plus scales) take their stored bytes out of the budget, not their
dequantised size. ``weight_memory`` says how many bytes that is (the engine's KV-sizing line, the
engine core's ``Ready.weight_bytes`` and the server's ``deepinfer_model_weight_bytes`` report it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.backends.cache_spec import KVCacheSpec
from deepinfer.engine.sched_output import ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.model_runner import ModelRunner

# Sampled with the sampler's heaviest path (temperature, top-k and top-p): its sort is the step's
# largest temporary at a wide vocabulary.
_SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
# Stored dtypes of quantised weight values (FP8 e4m3/e5m2; MXFP4 two e2m1 per uint8 byte; e8m0 bytes).
_QUANTISED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8)


@dataclass(frozen=True, slots=True)
class WeightMemory:
    """Bytes a model's weights occupy as held (each storage counted once, views and tied weights
    included once): ``total_bytes`` of every parameter, buffer and tensor attribute of its modules;
    ``quantised_bytes`` of those that are quantised values (FP8 / packed FP4 bytes) or their scales
    (a tensor whose name ends in ``scale`` or ``scale_inv``); ``by_dtype`` the total per dtype name."""

    total_bytes: int
    quantised_bytes: int
    by_dtype: dict[str, int]


def _module_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every parameter, buffer and plain tensor attribute of every module."""
    for prefix, module in model.named_modules():
        dotted = f"{prefix}." if prefix else ""
        for bag in (module._parameters, module._buffers):
            for name, tensor in bag.items():
                if tensor is not None:
                    yield dotted + name, tensor
        for name, value in vars(module).items():
            if isinstance(value, Tensor) and not isinstance(value, torch.nn.Parameter):
                yield dotted + name, value


def weight_memory(model: torch.nn.Module) -> WeightMemory:
    """What ``model``'s weights take in memory, as stored (see ``WeightMemory``). Meta tensors count
    their nominal bytes."""
    seen: set[tuple[str, int]] = set()
    total = quantised = 0
    by_dtype: dict[str, int] = {}
    for name, tensor in _module_tensors(model):
        if tensor.device.type == "meta":
            size = tensor.numel() * tensor.element_size()
        else:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            size = storage.nbytes()
        total += size
        dtype = str(tensor.dtype).removeprefix("torch.")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
        if tensor.dtype in _QUANTISED_DTYPES or name.endswith(("scale", "scale_inv")):
            quantised += size
    return WeightMemory(total, quantised, dict(sorted(by_dtype.items())))


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
