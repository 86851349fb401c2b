"""The weights' memory as held (``deepinfer.worker.memory_profile.weight_memory``): each storage once,
FP8 values and scales at their stored bytes; what the engine reports of the bundled FP8 model, in
its KV-sizing accounting, its ready message and the server's ``deepinfer_model_weight_bytes``."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors import safe_open
from torch import nn

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model_zoo import PACKAGED_MODELS
from deepinfer.worker.memory_profile import weight_memory

FP8_MODEL = PACKAGED_MODELS / "deepinfer-tiny-coder-fp8"
OPTIONS = {"num_kv_blocks": 64, "max_model_len": 256, "detokenize": False}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 160 bytes
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage
        self.values = nn.Parameter(torch.zeros(8, 6, dtype=torch.float8_e4m3fn), requires_grad=False)  # 48
        self.values_scale = nn.Parameter(torch.ones(1, 1), requires_grad=False)  # 4
        self.register_buffer("table", torch.zeros(3, dtype=torch.float64))  # 24
        self.view = self.embed.weight.data[:2]  # a plain attribute viewing the embedding: no new bytes
        self.cache = torch.zeros(5, dtype=torch.bfloat16)  # a plain tensor attribute: 10


def test_each_storage_counts_once_and_quantised_weights_at_their_bytes() -> None:
    memory = weight_memory(Toy())
    assert memory.total_bytes == 160 + 48 + 4 + 24 + 10
    assert memory.quantised_bytes == 48 + 4
    assert memory.by_dtype == {"bfloat16": 10, "float32": 164, "float64": 24, "float8_e4m3fn": 48}
    with torch.device("meta"):
        meta = Toy()
    assert weight_memory(meta).quantised_bytes == 52  # nominal bytes on the meta device


def _stored_fp8() -> tuple[int, int, int]:
    """(FP8 value bytes, their scale bytes, kv_b_proj's share of both) in the bundled checkpoint."""
    values = scales = kv_b = 0
    with safe_open(FP8_MODEL / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            size = t.numel() * t.element_size()
            if t.dtype == torch.float8_e4m3fn:
                values += size
            elif name.endswith("weight_scale_inv"):
                scales += size
            else:
                continue
            kv_b += size if ".kv_b_proj." in name else 0
    return values, scales, kv_b


@pytest.fixture
def reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference backend keeps FP8 weights as stored whatever kernels the fast backend has."""
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "reference")


@pytest.mark.usefixtures("reference_backend")
def test_the_engine_holds_the_bundled_fp8_model_at_its_stored_bytes() -> None:
    """Every FP8 value and scale the checkpoint stores is held as stored, except kv_b_proj, which is
    dequantised once at load for the absorbed MLA path; the rest is float32 (the CPU's model dtype)."""
    values, scales, kv_b = _stored_fp8()
    engine = LLMEngine(EngineConfig(model=str(FP8_MODEL), **OPTIONS))
    held = engine.weight_memory
    assert held.quantised_bytes == values + scales - kv_b
    fp8 = held.by_dtype["float8_e4m3fn"]
    assert fp8 < values  # kv_b_proj's share is not held as FP8
    dequantised = LLMEngine(EngineConfig(model=str(FP8_MODEL), weights="fp32", **OPTIONS)).weight_memory
    assert dequantised.quantised_bytes == 0 and "float8_e4m3fn" not in dequantised.by_dtype
    # each FP8 value held instead of its float32 copy saves 3 bytes, less the scales held beside it
    assert dequantised.total_bytes - held.total_bytes == 3 * fp8 - (held.quantised_bytes - fp8)


@pytest.mark.usefixtures("reference_backend")
def test_metrics_report_the_weights_as_held() -> None:
    from tests.server.conftest import start_server

    served = start_server(FP8_MODEL, engine={"num_kv_blocks": 64, "max_model_len": 256})
    handle = next(served)
    try:
        assert handle.client.weight_bytes == handle.engine.weight_memory.total_bytes
        assert "# TYPE deepinfer_model_weight_bytes gauge" in httpx.get(f"{handle.url}/metrics").text
        assert handle.metric("deepinfer_model_weight_bytes") == handle.engine.weight_memory.total_bytes > 0
    finally:
        served.close()
