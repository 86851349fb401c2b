"""Sliding-window layers after a KV-store hit: exact replay equals a cold run, bounded replay drifts
by a measured amount, and the replayed token count does not grow with the context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.kvstore.config import KVStoreConfig
from tests.model.hf_models import make_hf_checkpoint

WINDOW = 24
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("swa-model")
    make_hf_checkpoint(path, seed=3)
    raw = json.loads((path / "config.json").read_text())
    raw.update(sliding_window=WINDOW, layer_types=LAYER_TYPES)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def prompt(length: int) -> list[int]:
    return [(i * 37 + 11) % 250 + 2 for i in range(length)]


def run(model: Path, ids: list[int], store: KVStoreConfig | None):
    """(output, prompt tokens the engine computed) of one request on a fresh engine."""
    llm = LLM(model=str(model), num_kv_blocks=64, kv_store=store)
    computed = []
    execute = llm.engine.runner.execute

    def counting(scheduled):
        computed.append(sum(r.num_new_tokens for r in scheduled.requests if r.num_computed_tokens < len(ids)))
        return execute(scheduled)

    llm.engine.runner.execute = counting
    out = llm.generate([ids], SP)[0]
    if llm.engine.kv_connector is not None:
        llm.engine.kv_connector.close()  # written, and the directory released for the next engine
    return out, computed[0] if len(computed) == 1 else sum(computed[: -(SP.max_tokens - 1)])


def logprob_rows(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]


def max_drift(a, b) -> float:
    drift = 0.0
    for ra, rb in zip(logprob_rows(a), logprob_rows(b)):
        for t in ra.keys() & rb.keys():
            drift = max(drift, abs(ra[t] - rb[t]))
    return drift


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_replay_after_a_store_hit(swa_model: Path, tmp_path: Path, mode: str) -> None:
    replays = {}
    for length in (200, 360):
        ids = prompt(length)
        cold, _ = run(swa_model, ids, None)
        store = KVStoreConfig(
            host_cache_gib=0.01, path=str(tmp_path / str(length)), swa_replay=mode, swa_replay_tokens=8
        )
        run(swa_model, ids, store)  # writes the prefix
        hit, computed = run(
            swa_model, ids, store
        )  # a new engine: the prefix comes from disk, SWA state does not
        cached_tokens = (length - 1) // 16 * 16
        replays[length] = computed - (length - cached_tokens)
        assert hit.num_cached_tokens == cached_tokens - replays[length]
        drift = max_drift(hit, cold)
        if mode == "exact":
            assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
            assert drift < 1e-4
        else:
            assert 0 < drift < 10  # an approximation: measured, reported by bench/kv_store.py
    expected = 2 * (WINDOW - 1) if mode == "exact" else 8
    assert replays == {200: expected, 360: expected}  # independent of the context length
