"""The models shipped inside the package, and how a ``--model`` value names one.

``deepinfer-tiny-coder`` (float32, the default) and ``deepinfer-tiny-coder-fp8`` (its FP8
block-quantised copy, in DeepSeek's checkpoint format: ``tools/quantize_fp8.py``) live in
``deepinfer/models/``. A ``--model`` value (or ``LLM(model=...)``) that is not an existing path but is
the name of a packaged model selects that folder; anything else is a path, taken as given.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer import envs

PACKAGED_MODELS = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL = "deepinfer-tiny-coder"


def packaged_models() -> list[str]:
    """Names of the model folders shipped in the package (each holds a config.json), sorted."""
    return sorted(p.name for p in PACKAGED_MODELS.iterdir() if (p / "config.json").is_file())


def default_model_path() -> Path:
    """``DEEPINFER_MODEL`` if set, else the packaged deepinfer-tiny-coder folder."""
    override = envs.get("DEEPINFER_MODEL")
    path = resolve_model(override) if override else PACKAGED_MODELS / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"default model not found at {path} (set DEEPINFER_MODEL or pass --model / LLM(model=...))"
        )
    return path


def resolve_model(model: str | Path | None) -> Path:
    """The folder ``model`` names: ``None`` -> the default model; an existing path -> itself; the
    name of a packaged model (``packaged_models()``) -> its folder in the package; anything else ->
    the path as given (the loader then reports what is missing there)."""
    if model is None:
        return default_model_path()
    path = Path(model)
    if path.exists():
        return path
    if path.name == str(model) and (PACKAGED_MODELS / path.name / "config.json").is_file():
        return PACKAGED_MODELS / path.name
    return path


def model_argument(value: str) -> str:
    """argparse ``type=`` of a ``--model`` option: a packaged model's name becomes its folder."""
    return str(resolve_model(value))
