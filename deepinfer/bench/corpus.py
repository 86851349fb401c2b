"""The held-out Python standard-library files: the text every benchmark and evaluation draws from.

deepinfer-tiny-coder was trained on the other files; the split is a stable hash of each file's path
relative to the stdlib folder (the training script uses these same functions), so held-out really
means unseen in training.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_PREFIXES = {
    "site-packages/": "third-party packages installed into the interpreter, not the standard library",
    "lib2to3/tests/data/": "lib2to3 fixtures: Python 2 syntax, a BOM, CRLF and odd source encodings",
    "test/encoded_modules/": "fixtures in legacy (non-UTF-8) source encodings",
    "test/tokenizedata/": "tokenizer fixtures with deliberately bad syntax or encoding declarations",
    "pydoc_data/": "generated documentation text (a single ~750 kB dict literal of prose)",
}
GENERATED_CODEC_MARKER = "with gencodec.py"  # header of the generated charmap codec tables in encodings/
VALIDATION_PER_MILLE = 30  # 3 % of files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_hash(relative_path: str) -> int:
    """Stable 64-bit hash of a relative path (first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big")


def is_heldout(relative_path: str) -> bool:
    return path_hash(relative_path) % 1000 < VALIDATION_PER_MILLE


def exclusion_reason(relative_path: str, text: str | None) -> str | None:
    """Why a file is left out of the corpus (None if it is in). ``text`` None means unreadable."""
    prefix = next((p for p in EXCLUDED_PREFIXES if relative_path.startswith(p)), None)
    if prefix is not None:
        return prefix
    if text is None:
        return "invalid"
    try:
        ast.parse(text, filename=relative_path)
    except (SyntaxError, ValueError):
        return "invalid"
    if relative_path.startswith("encodings/") and GENERATED_CODEC_MARKER in text[:500]:
        return "generated-codec"
    return None


def read_source(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def heldout_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every held-out corpus file, sorted by path."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if not is_heldout(relative):
            continue
        text = read_source(path)
        if exclusion_reason(relative, text) is None:
            files.append((relative, text))
    return files
