"""The shipped deepinfer-tiny-coder: a standard checkpoint, and a real model of Python code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer import LLM
from deepinfer.bench import quality
from deepinfer.model_zoo import default_model_path
from tests.conftest import REPO_ROOT
from tests.model.stepping import prompt_logits


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(default_model_path()))


def test_perplexity_is_far_below_the_unigram_baseline(llm: LLM) -> None:
    windows = quality.heldout_slice(llm, windows=8, length=512)
    model_ppl = quality.perplexity(llm, windows)
    unigram_ppl = quality.unigram_perplexity(windows, llm.engine.model_config.vocab_size)
    assert model_ppl < 0.5 * unigram_ppl, f"perplexity {model_ppl:.1f} vs unigram {unigram_ppl:.1f}"


def test_transformers_loads_the_folder_and_agrees(llm: LLM) -> None:
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    ids = llm.engine.tokenizer.encode("import os\n\n\ndef read_config(path):\n    with open(path) as f:\n")
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = prompt_logits(llm.engine, ids)
    assert ((ours - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_model_card_states_the_figures() -> None:
    folder = default_model_path()
    card = (folder / "README.md").read_text()
    for needle in ("perplexity", "unigram", "MTP", "parameters", "training"):
        assert needle.lower() in card.lower(), needle
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] >= 8192 and config["num_nextn_predict_layers"] == 1
    assert sum(f.stat().st_size for f in folder.iterdir()) < 40 * 2**20


def test_run_prints_python_looking_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.run", "--max-tokens", "48", "def read_config(path):"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "DEEPINFER_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def read_config(path):\n    ")
    assert "model deepinfer-tiny-coder" in proc.stderr
