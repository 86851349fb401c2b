"""What every benchmark result records about where and how it ran."""

from __future__ import annotations

import os
import platform as stdlib_platform
import subprocess
import time
from pathlib import Path

import torch

from deepinfer import __version__


def git_commit(repo: Path | None = None) -> str:
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    commit = out.stdout.strip()
    if out.returncode != 0 or not commit:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10
    )
    return commit + ("-dirty" if dirty.stdout.strip() else "")


def environment(engine) -> dict:
    """Platform, chip, model, commit and host facts of a run (``engine``: an LLMEngine)."""
    return {
        "deepinfer_version": __version__,
        "git_commit": git_commit(),
        "platform": engine.platform.name,
        "device": engine.platform.device_name,
        "chip": engine.platform.chip.key,
        "model": engine.checkpoint.path.name,
        "model_path": str(engine.checkpoint.path),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "engine_config": engine.config.model_dump(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "host": stdlib_platform.node(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
