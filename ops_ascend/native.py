"""The Ascend C kernels built from ``ops_ascend/csrc``: loading, self-test, and the choice of path.

``ops_ascend/csrc/build.sh`` (run by ``DEEPINFER_ACCELERATOR=ascend ./build.sh`` on a CANN host) builds
``libdeepinfer_ascend_ops.so``, which registers ``torch.ops.deepinfer_ascend.sample`` (TORCH_LIBRARY, with
a Meta implementation for graph capture and fake-tensor tracing). On first use the library is loaded and
the kernel is checked against the reference sampler on a fixed batch that exercises every filter and
greedy rows; only a kernel that draws exactly the reference's tokens is used. When it is not, the
torch path (the reference implementation) runs, declared through the op registry as a reference
fallback with the reason (a WARNING, listed by ``OpTable.describe()``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from deepinfer.backends.reference import sampling as reference
from deepinfer.logger import get_logger

logger = get_logger(__name__)

LIBRARY = Path(__file__).resolve().parent / "csrc" / "build" / "lib" / "libdeepinfer_ascend_ops.so"

Sampler = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def self_test_batch(device: torch.device) -> tuple[Tensor, ...]:
    """(logits, temperature, top_k, top_p, min_p, seeds, offsets) on ``device``: greedy rows, each filter
    alone and combined, exact logit ties (top-k and top-p boundaries fall inside runs of equal values),
    and a vocabulary that is not a multiple of any tile size."""
    gen = torch.Generator().manual_seed(20260)
    rows, vocab = 12, 1031
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16).float()
    logits[:, 100:140] = logits[:, 100:140].amax()  # a run of tied maxima
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 1.0, 0.9, 1.1, 1.0])
    top_k = torch.tensor([0, 0, 50, 0, 20, 0, 7, 0, 1, 30, 0, 1024], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.8, 0.95, 1.0, 0.6, 0.3, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.1, 0.0, 0.05, 0.0, 0.0, 0.3, 0.0])
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    offsets = torch.randint(0, 4096, (rows,), generator=gen)
    return tuple(t.to(device) for t in (logits, temperature, top_k, top_p, min_p, seeds, offsets))


def self_test(kernel: Sampler, device: torch.device) -> str | None:
    """None when ``kernel`` draws the reference's tokens on the self-test batch, else what went wrong."""
    batch = self_test_batch(device)
    try:
        tokens = kernel(*batch)
    except Exception as exc:  # a kernel that cannot run here is reported, never raised at sampling time
        return f"raised {type(exc).__name__}: {exc}"
    expected = reference.sample(*(t.cpu() for t in batch))
    if tokens.dtype != torch.int64 or tuple(tokens.shape) != tuple(expected.shape):
        return f"returned {tokens.dtype} {tuple(tokens.shape)}, expected int64 {tuple(expected.shape)}"
    wrong = (tokens.cpu() != expected).nonzero().flatten().tolist()
    return f"rows {wrong} drew different tokens than the reference" if wrong else None


def load_sampling_kernel(library: Path, device: torch.device) -> tuple[Sampler | None, str]:
    """(the library's sampling op, how it was chosen) if it loads and passes its self-test on
    ``device``, else (None, why not): the caller declares that fallback through the op registry."""
    if not library.is_file():
        return None, f"the Ascend C kernel is not built ({library} missing)"
    try:
        torch.ops.load_library(str(library))
        kernel = torch.ops.deepinfer_ascend.sample
    except (OSError, RuntimeError, AttributeError) as exc:
        return None, f"the Ascend C kernel {library} did not load ({exc})"
    failure = self_test(kernel, device)
    if failure is not None:
        return None, f"the Ascend C kernel failed its self-test ({failure})"
    logger.info("sampling: using the Ascend C kernel (%s, self-test passed)", library)
    return kernel, f"the Ascend C kernel ({library}, self-test passed)"


@functools.cache
def sampling_kernel(device: torch.device) -> tuple[Sampler | None, str]:
    """The Ascend C sampler for ``device`` and how it was chosen, decided once per device (None, why
    not: use the torch path)."""
    if device.type != "npu":
        return None, f"device {device} is not an NPU"
    return load_sampling_kernel(LIBRARY, device)


def main() -> int:
    """CI report (``python -m deepinfer.ops_ascend.native`` on an NPU host): whether the Ascend C library
    is built, loads and passes its self-test on NPU 0. Exit status 1 only for a built kernel that fails."""
    from deepinfer.ops_ascend.npu import torch_npu

    torch_npu()
    if not LIBRARY.is_file():
        print(f"ascend custom ops: not built ({LIBRARY} missing); sampling uses the torch path")
        return 0
    kernel, why = load_sampling_kernel(LIBRARY, torch.device("npu", 0))
    verdict = "self-test passed" if kernel is not None else f"NOT USED: {why}"
    print(f"ascend custom ops: {LIBRARY}: deepinfer_ascend::sample {verdict}")
    return 0 if kernel is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
