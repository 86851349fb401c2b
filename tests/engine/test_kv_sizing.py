"""The KV cache, sized from free memory, leaves one profiled step at the token budget free: the
platform's peak-memory measurement, the profiled step's shape, the arithmetic and its refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.malloc_tuning import MALLOC_TUNABLES
from deepinfer.platform.cpu import CpuPlatform
from deepinfer.worker.memory_profile import profile_shape

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _run(code: str, malloc_tuned: bool = True) -> dict:
    """``code`` in a fresh process (by default with glibc's malloc tuned, as the command-line entry
    points run); it prints one JSON line."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if malloc_tuned:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cpu_peak_is_the_high_water_mark_above_memory_in_use() -> None:
    """64 MiB allocated and freed, then 16 MiB: the peak is the 64 MiB, not their sum nor what is left
    (nothing). A small step measured next needs next to nothing: the mark was reset, though glibc's
    default malloc gave the 64 MiB back (the resident set fell below the old mark)."""
    out = _run(
        """
        import json, torch
        from deepinfer.platform.cpu import CpuPlatform
        platform = CpuPlatform(CpuPlatform.detect())
        def step():
            a = torch.ones(16 << 20)  # 64 MiB of float32
            del a
            b = torch.ones(4 << 20)
            del b
        print(json.dumps([platform.peak_memory_of(step), platform.peak_memory_of(lambda: torch.ones(256))]))
        """,
        malloc_tuned=False,
    )
    step, small = out
    assert 63 * MIB <= step <= 72 * MIB, step / MIB
    assert small <= 2 * MIB, small / MIB


def test_the_profiled_step_spreads_the_budget_over_the_most_requests() -> None:
    assert profile_shape(8192, 256, 100_000) == [32] * 256
    assert profile_shape(100, 256, 4096) == [1] * 100
    assert profile_shape(8192, 2, 1000) == [1000, 1000]  # a budget no step can reach is capped
    assert profile_shape(10, 3, 50) == [4, 3, 3]


def test_the_kv_cache_leaves_the_profiled_peak_free(tiny_model: Path) -> None:
    """With 1 GiB free, the KV cache takes 90% of it less the peak its profiled step needed: a step of
    8192 tokens over 256 requests needs tens of MiB more than one of 64 tokens, and gets that many
    fewer blocks."""
    out = _run(
        f"""
        import json
        from deepinfer import LLM
        from deepinfer.platform.cpu import CpuPlatform
        FREE = 1 << 30
        CpuPlatform.mem_get_info = lambda self, index=0: (FREE, 4 * FREE)
        measured = []
        profile = CpuPlatform.peak_memory_of
        def recorded(self, fn):
            measured.append(profile(self, fn))
            return measured[-1]
        CpuPlatform.peak_memory_of = recorded
        rows = []
        for budget in (64, 8192):
            engine = LLM({str(tiny_model)!r}, max_num_batched_tokens=budget, max_num_seqs=256).engine
            per_block = engine.cache_spec.bytes_per_block() * engine.model.num_cache_layers
            rows.append([measured[-1], engine.kv_cache.pool.num_blocks, per_block])
        print(json.dumps(rows))
        """
    )
    (small_peak, small_blocks, per_block), (large_peak, large_blocks, _) = out
    free = 1 << 30
    assert small_blocks == (int(free * 0.9) - small_peak) // per_block
    assert large_blocks == (int(free * 0.9) - large_peak) // per_block
    assert large_peak >= small_peak + 20 * MIB, (small_peak / MIB, large_peak / MIB)
    assert large_blocks < small_blocks


def test_no_room_for_the_kv_cache_after_the_step_is_a_clear_error(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def heavy_step(self: CpuPlatform, fn) -> int:
        fn()
        return 3 << 30

    monkeypatch.setattr(CpuPlatform, "mem_get_info", lambda self, index=0: (2 << 30, 8 << 30))
    monkeypatch.setattr(CpuPlatform, "peak_memory_of", heavy_step)
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens=512 tokens over 256 requests needs 3\.00 GiB"
    ):
        LLM(str(tiny_model), max_num_batched_tokens=512)
    # Sized explicitly, nothing is profiled.
    assert LLM(str(tiny_model), max_num_batched_tokens=512, kv_cache_memory_gib=0.01).engine.kv_cache
