"""A CPU emulation of exactly the torch_npu ops deepinfer.ops_ascend calls, for tests only.

Each op is written from its documentation (``torch_npu/_op_plugin_docs.py`` of torch_npu 2.13.0, the
schema / meta registrations where that file has no entry, and the CANN aclnn formulas it defers to): the
same signatures and DEFAULTS (``scale=1.0``, ``cache_mode='PA_NZ'`` ...), the documented layouts, and the
documented argument checks, which raise. Computation is float32 on CPU tensors. ``install()`` puts the
emulation into ``sys.modules['torch_npu']`` and ``torch.npu`` (streams, events, graphs with task groups
and updates, ``get_device_name``); ``uninstall()`` removes both. The emulated device is an A2
(``Ascend910B3``) unless ``DEEPINFER_EMULATED_NPU`` names another at install or ``set_device_name``
changes it: ops documented for some chips only (FP8 quantisation: 950) raise on the others. Nothing
outside tests/ascend imports this package.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from deepinfer import envs
from tests.ascend.emulation import attention, cache, elementwise, moe, quant, runtime

OPS = {
    name: getattr(module, name)
    for module in (attention, cache, elementwise, moe, quant)
    for name in dir(module)
    if name.startswith(("npu_", "_npu_"))
}
RUNTIME = (
    "NPUGraph",
    "graph",
    "Stream",
    "current_stream",
    "stream",
    "synchronize",
    "ExternalEvent",
    "is_current_stream_capturing",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "get_device_name",
)
set_device_name = runtime.set_device_name


def _torch_npu() -> ModuleType:
    module = ModuleType("torch_npu", "Emulated torch_npu (tests/ascend/emulation).")
    for name, op in OPS.items():
        setattr(module, name, op)
    for name, dtype in quant.DTYPES.items():
        setattr(module, name, dtype)
    return module


def _npu_runtime() -> ModuleType:
    module = ModuleType("torch.npu", "Emulated torch.npu runtime (tests/ascend/emulation).")
    for name in RUNTIME:
        setattr(module, name, getattr(runtime, name))
    return module


def install() -> None:
    """Make ``import torch_npu`` and ``torch.npu`` resolve to the emulation."""
    if "torch_npu" in sys.modules and not getattr(sys.modules["torch_npu"], "__emulated__", False):
        raise RuntimeError("a real torch_npu is loaded; the emulation must not replace it")
    runtime.set_device_name(envs.get("DEEPINFER_EMULATED_NPU"))
    module = _torch_npu()
    module.__emulated__ = True
    sys.modules["torch_npu"] = module
    torch.npu = _npu_runtime()


def uninstall() -> None:
    sys.modules.pop("torch_npu", None)
    if hasattr(torch, "npu"):
        del torch.npu
