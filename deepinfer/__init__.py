"""deepinfer: an inference engine and serving stack for DeepSeek-family models.

Public API: ``LLM`` and ``SamplingParams`` (imported lazily, so ``import deepinfer`` stays light and
never imports a vendor library such as ``torch_npu`` or ``triton``).

Layout: the design card's top-level folders ``backends/``, ``ops_cuda/``, ``ops_ascend/`` and
``platform/`` are importable as ``deepinfer.backends`` and so on. A wheel maps them into this package;
in a source checkout (a ``pyproject.toml`` beside this package) the repository root is appended to
this package's ``__path__`` so that the same names resolve to the top-level folders.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_REPO_ROOT, "pyproject.toml")) and os.path.isdir(
    os.path.join(_REPO_ROOT, "backends")
):
    __path__.append(_REPO_ROOT)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deepinfer.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
