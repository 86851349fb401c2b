"""Test-wide setup: the CPU platform unless a test chooses otherwise, and a tiny random checkpoint with a
real byte-level BPE tokenizer (``tiny_model``) for engine-level tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.model.hf_models import make_hf_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent


# The test models are tiny: one intra-op thread is faster than two and immune to a busy second core.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cpu_platform(monkeypatch: pytest.MonkeyPatch):
    """Pin DEEPINFER_ACCELERATOR=cpu and forget any platform or op table a previous test chose."""
    from deepinfer.backends.registry import set_active_ops
    from deepinfer.platform.registry import set_current_platform

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", os.environ.get("DEEPINFER_TEST_ACCELERATOR", "cpu"))
    set_current_platform(None)
    set_active_ops(None)
    yield
    set_current_platform(None)
    set_active_ops(None)


def run_python(code: str, cwd: Path | str = REPO_ROOT, env: dict[str, str] | None = None, timeout: int = 120):
    """Run ``python -c code`` in a subprocess with this interpreter; returns CompletedProcess."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, 'héllo wörld ✓ 日本語 🙂')\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 20


def write_tokenizer(path: Path, vocab_size: int = 384) -> int:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "add_bos_token": True})
    )
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    vocab = write_tokenizer(path)
    make_hf_checkpoint(path, vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    write_tokenizer(path)  # save_pretrained leaves tokenizer files alone; rewrite to be sure
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return path
