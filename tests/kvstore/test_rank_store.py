"""Data-parallel ranks each own a subfolder of the disk tier (issue 34, defect 16): ``rank-N``, with
an even share of its capacity; the shared tier stays one directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.kvstore.config import KVStoreConfig
from deepinfer.kvstore.owner import LOCK_NAME
from deepinfer.model_zoo import default_model_path
from deepinfer.parallel.rank import rank_config
from tests.parallel.dp_helpers import ENGINE


def test_each_rank_gets_its_own_disk_folder_and_share_and_the_shared_tier_stays(tmp_path: Path) -> None:
    store = KVStoreConfig(path=str(tmp_path / "disk"), capacity_gib=8.0, shared_path=str(tmp_path / "shared"))
    config = EngineConfig(model=str(default_model_path()), data_parallel_size=4, kv_store=store)
    configs = [rank_config(config, rank) for rank in range(4)]
    assert [c.kv_store.path for c in configs] == [str(tmp_path / "disk" / f"rank-{r}") for r in range(4)]
    assert {c.kv_store.capacity_gib for c in configs} == {2.0}
    assert {c.kv_store.shared_path for c in configs} == {str(tmp_path / "shared")}
    assert all(c.kv_store.host_cache_gib == store.host_cache_gib for c in configs)
    alone = EngineConfig(model=str(default_model_path()), kv_store=store)
    assert rank_config(alone, 0) is alone  # one process: the path as given
    shared_only = EngineConfig(
        model=str(default_model_path()),
        data_parallel_size=2,
        kv_store=KVStoreConfig(shared_path=store.shared_path),
    )
    assert rank_config(shared_only, 1) is shared_only


@pytest.fixture
def _one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_NUM_THREADS", "1")  # the ranks share this machine's cores


@pytest.mark.usefixtures("_one_thread_per_rank")
def test_two_data_parallel_ranks_with_a_disk_tier_start_and_serve(tmp_path: Path) -> None:
    """Before: both ranks opened the same folder (and with the owner lock, the second failed)."""
    model = default_model_path()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    store = KVStoreConfig(host_cache_gib=0.01, path=str(tmp_path), capacity_gib=1.0)
    llm = LLM(model=str(model), data_parallel_size=2, enable_expert_parallel=True, kv_store=store, **ENGINE)
    procs = llm.engine.procs
    try:
        prompts = [[(7 * i + j) % (vocab - 2) + 2 for j in range(40)] for i in range(4)]
        outs = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=2)
        )
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
        for rank in range(2):
            assert (tmp_path / f"rank-{rank}" / LOCK_NAME).is_file()
            assert (tmp_path / f"rank-{rank}" / "kv1").is_dir()
        assert not (tmp_path / "kv1").exists()
    finally:
        llm.close()
    assert all(not p.is_alive() for p in procs), "a rank process outlived close()"
    for rank in range(2):  # each rank's engine closed its store: the stats record is written
        assert list((tmp_path / f"rank-{rank}" / "kv1").rglob("stats/*.json")), (
            f"rank {rank} never closed its store"
        )
