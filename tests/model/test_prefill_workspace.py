"""Prefill over a long cached context runs in context tiles: the same attention as one expanded call
(within float32 rounding), with peak memory that does not grow with the context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from deepinfer.model.attn_metadata import CONTEXT_TILE_TOKENS
from deepinfer.worker.inputs import InputBuilder
from tests.model.prefill_workspace import PrefillCase

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_tiled_prefill_matches_one_expanded_call() -> None:
    # Decode requests first, then prefill chunks with and without context; tiles of 1 and 7 keys cut
    # through requests, 50 and 141 span several, 10**9 is one call (no tiles).
    case = PrefillCase(contexts=[37, 0, 100, 5], chunks=[9, 20, 3, 17], decodes=[12, 40])
    whole = case.forward(10**9)
    for tile in (1, 7, 50, 141):
        meta = (
            InputBuilder(case.block_size, torch.device("cpu"), context_tile=tile).prepare(case.requests).meta
        )
        tiles = meta.prefill.context_tiles
        assert len(tiles) == -(-142 // tile)
        assert sum(t.slots.numel() for t in tiles) == 142 and max(t.slots.numel() for t in tiles) <= tile
        out = case.forward(tile)
        err = float((out - whole).norm() / whole.norm())
        assert err < 1e-5, f"context tile {tile}: relative error {err:.2e} against one expanded call"


def test_short_context_is_one_call() -> None:
    case = PrefillCase(contexts=[CONTEXT_TILE_TOKENS - 8], chunks=[4], decodes=[])
    builder = InputBuilder(case.block_size, torch.device("cpu"))
    assert builder.prepare(case.requests).meta.prefill.context_tiles == ()


def test_prefill_workspace_does_not_grow_with_the_context() -> None:
    """Peak resident memory of one chunk (128 tokens) over 1k, 8k and 16k cached tokens, each measured
    in one fresh process from a reset high-water mark; and the untiled path over 16k, which shows the
    measurement sees the workspace it bounds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
    untiled = 10**9
    args = ["--context", "1024", "8192", "16384", "16384"]
    args += ["--context-tile", *[str(CONTEXT_TILE_TOKENS)] * 3, str(untiled)]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.model.prefill_workspace", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    peak = {(r["context"], r["context_tile"]): r["peak_extra_bytes"] for r in rows}
    short, mid, long = (peak[(n, CONTEXT_TILE_TOKENS)] for n in (1024, 8192, 16384))
    report = {k: f"{v / MiB:.1f} MiB" for k, v in peak.items()}
    bound = 64 * MiB  # a few tiles of expanded keys, values and scores at this config
    assert long - short < bound, f"16k context over 1k: {(long - short) / MiB:.1f} MiB more; {report}"
    assert abs(long - mid) < 4 * MiB, f"tiled workspace changed between 8k and 16k: {report}"
    assert peak[(16384, untiled)] - short > bound, f"the measurement misses the untiled workspace: {report}"
