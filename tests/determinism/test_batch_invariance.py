"""Deterministic mode: a needle request's tokens and logprobs are bit-identical alone and among 1, 7
and 31 random batch mates, with prompt chunks of 16 / 64 tokens or whole, with its prefix computed or
read from the prefix cache, with speculative decoding on or off, greedy and seeded at temperature 0.8;
on the bundled model and on a random DeepSeek-V3 config. Without the mode, the same suite finds
differences (so it can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.model_zoo import default_model_path
from tests.determinism.needles import MATES, SETTINGS, differences, run_needles
from tests.model.hf_models import add_mtp_weights, make_hf_checkpoint


@pytest.fixture(scope="module")
def random_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DeepSeek-V3 config (q-LoRA, grouped noaux_tc routing, a shared expert) with an MTP layer."""
    root = tmp_path_factory.mktemp("random-v3")
    hf = make_hf_checkpoint(root / "hf", seed=3, vocab_size=512, num_experts_per_tok=3)
    add_mtp_weights(hf, root / "hf", root / "mtp", seed=4)
    return root / "mtp"


MODELS = {"bundled": (lambda _: default_model_path(), 8192), "random_v3": (lambda f: f, 512)}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_needles_are_bit_identical_in_deterministic_mode(model: str, random_v3: Path) -> None:
    path_of, vocab = MODELS[model]
    results = run_needles(path_of(random_v3), deterministic=True, vocab=vocab)
    assert len(results) == len(SETTINGS) * len(MATES) * 2
    assert differences(results) == []


def test_without_the_mode_the_suite_finds_differences(random_v3: Path) -> None:
    results = run_needles(random_v3, deterministic=False, vocab=512)
    found = differences(results)
    print("deterministic=False differs in:\n" + "\n".join(found))
    assert found, "the suite cannot fail: no case differs even without deterministic mode"
