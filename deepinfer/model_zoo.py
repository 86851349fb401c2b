"""Where the default model lives: the deepinfer-tiny-coder checkpoint shipped inside the package."""

from __future__ import annotations

from pathlib import Path

from deepinfer import envs

PACKAGED_MODELS = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL = "deepinfer-tiny-coder"


def default_model_path() -> Path:
    """``DEEPINFER_MODEL`` if set, else the packaged deepinfer-tiny-coder folder."""
    override = envs.get("DEEPINFER_MODEL")
    path = Path(override) if override else PACKAGED_MODELS / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"default model not found at {path} (set DEEPINFER_MODEL or pass --model / LLM(model=...))"
        )
    return path
