"""Access to ``torch_npu``, imported on first use and never at import time.

Importing ``deepinfer.ops_ascend`` only registers the op implementations (the registry and the layout tests
import it on hosts without CANN, where importing ``torch_npu`` would break ``import torch``). The first op
call imports ``torch_npu``; from then on it is an ``sys.modules`` lookup. Tests install an emulation under
the same name.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (imported now if it was not yet); importing it also creates ``torch.npu``."""
    return importlib.import_module("torch_npu")
