"""Ascend backend (``DEEPINFER_ACCELERATOR=ascend``): op implementations on torch_npu and Ascend C.

Activation imports this package, which fills ``OPS``; ``torch_npu`` is imported only here and only on
activation, never by ``import deepinfer``. Until the torch_npu implementations land, every op is
declared to run the plain-PyTorch reference implementation on the NPU; the registry logs each such op.
"""

from deepinfer.backends.registry import OpTable, interface_ops

OPS = OpTable("deepinfer.ops_ascend")
OPS.use_reference_for(
    sorted(interface_ops()),
    reason="no torch_npu implementation yet; the PyTorch reference runs on the NPU",
)
