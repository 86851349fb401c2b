"""Host copies of the small per-step metadata tensors that the fused kernels take as host lists.

``npu_fused_infer_attention_score(_v2)`` take sequence lengths as host ``int`` lists, and
``npu_scatter_pa_kv_cache`` must not see padding slots. The engine hands every layer the same metadata
tensors in a step, so the device-to-host copy is made once per tensor and reused by all layers: an entry
is keyed by the tensor object (a weak reference, so a freed tensor whose id is reused never matches) and
its version counter (an in-place update, such as a graph runner refreshing a static buffer, invalidates
it).
"""

from __future__ import annotations

import weakref

from torch import Tensor

_MAX_ENTRIES = 64
_cache: dict[int, tuple[weakref.ref[Tensor], int, list[int]]] = {}


def host_list(t: Tensor) -> list[int]:
    """``t.tolist()`` for a 1-D integer tensor, copied to the host once per tensor and version."""
    entry = _cache.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    values = [int(v) for v in t.tolist()]
    if len(_cache) >= _MAX_ENTRIES:
        for key in [k for k, (ref, _, _) in _cache.items() if ref() is None]:
            del _cache[key]
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
    _cache[id(t)] = (weakref.ref(t), t._version, values)
    return values
