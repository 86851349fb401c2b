"""NVIDIA backend (``DEEPINFER_ACCELERATOR=nvidia``): op implementations for CUDA GPUs.

Activation imports this package, which fills ``OPS``. Until the Triton kernels land, every op is
declared to run the plain-PyTorch reference implementation on the CUDA device; the registry logs each
such op at activation, so a run never hides which code computed it.
"""

from deepinfer.backends.registry import OpTable, interface_ops

OPS = OpTable("deepinfer.ops_cuda")
OPS.use_reference_for(
    sorted(interface_ops()),
    reason="no Triton kernel yet; the PyTorch reference runs on the CUDA device",
)
