"""The engine with the KV store: hits from every tier, identical outputs, restart, bad files, sharing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kvstore.config import KVStoreConfig
from deepinfer.kvstore.record import HEADER_SIZE
from tests.conftest import REPO_ROOT

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompt(seed: int, length: int = 200) -> list[int]:
    return [(seed * 7919 + i * 31) % 360 + 3 for i in range(length)]


def make(model: Path, **store) -> LLM:
    return LLM(model=str(model), num_kv_blocks=40, kv_store=KVStoreConfig(host_cache_gib=0.01, **store))


def test_hits_from_host_and_disk_give_the_outputs_of_no_store(tiny_model: Path, tmp_path: Path) -> None:
    prompts = [prompt(1), prompt(2)]
    cold = LLM(model=str(tiny_model), num_kv_blocks=40).generate(prompts, GREEDY)
    llm = make(tiny_model, path=str(tmp_path))
    first = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in cold]
    # 40 device blocks: filler prompts evict the first ones from the device; host memory has them.
    llm.generate([prompt(s) for s in range(3, 6)], GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in cold]
    assert [o.num_cached_tokens for o in again] == [192, 192]  # 12 full blocks; the last token computes
    stats = llm.engine.kv_store_stats()
    assert stats["tiers"]["host"]["hits"] >= 12
    llm.engine.kv_connector.close()  # the old engine is gone: it owned the directory (owner.lock)
    # A new engine on the same path (a restart): the disk tier serves them.
    restarted = make(tiny_model, path=str(tmp_path))
    outs = restarted.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cold]
    assert [o.num_cached_tokens for o in outs] == [192, 192]
    assert restarted.engine.kv_store_stats()["tiers"]["disk"]["hits"] == 24


def test_bad_files_are_counted_misses_and_the_output_is_unchanged(tiny_model: Path, tmp_path: Path) -> None:
    p = prompt(7)
    cold = LLM(model=str(tiny_model), num_kv_blocks=40).generate([p], GREEDY)[0].outputs[0].token_ids
    llm = make(tiny_model, path=str(tmp_path))
    llm.generate([p], GREEDY)
    llm.engine.kv_connector.store.flush(10)
    packs = list(tmp_path.rglob("*.kvp"))
    assert packs and llm.engine.kv_store_stats()["tiers"]["disk"]["writes"] == 12
    raw = bytearray(packs[0].read_bytes())
    raw[HEADER_SIZE + 7] ^= 0x04  # one flipped bit in the pack's first block's payload
    packs[0].write_bytes(raw)
    (packs[0].parent / "empty.kvp").write_bytes(b"")  # and a zero-length pack
    llm.engine.kv_connector.close()  # a restart: the old engine releases the directory
    restarted = make(tiny_model, path=str(tmp_path))
    out = restarted.generate([p], GREEDY)[0]
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens < 192
    assert restarted.engine.kv_store_stats()["tiers"]["disk"]["corrupt_reads"] >= 2
    assert not packs[0].exists() and not (packs[0].parent / "empty.kvp").exists()


def test_another_model_or_layout_never_hits(tiny_model: Path, tmp_path: Path) -> None:
    p = prompt(9)
    llm = make(tiny_model, path=str(tmp_path))
    llm.generate([p], GREEDY)
    llm.engine.kv_connector.close()  # one owner per disk tier directory
    other = LLM(
        model=str(tiny_model), num_kv_blocks=40, dtype="bfloat16", kv_store=KVStoreConfig(path=str(tmp_path))
    )
    out = other.generate([p], GREEDY)[0]
    assert out.num_cached_tokens == 0  # another dtype is another namespace: a miss, not a wrong hit


def test_traffic_class_is_checked(tiny_model: Path, tmp_path: Path) -> None:
    llm = make(tiny_model, ttls="agent=3d,chat=7d,batch=1h")
    llm.generate([prompt(1)], SamplingParams(max_tokens=2, traffic_class="batch"))
    with pytest.raises(
        ValueError, match="traffic_class 'nightly' is unknown; configured classes: agent, chat, batch"
    ):
        llm.generate([prompt(1)], SamplingParams(max_tokens=2, traffic_class="nightly"))


SHARER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from deepinfer import LLM, SamplingParams
    from deepinfer.kvstore.config import KVStoreConfig
    model, shared, me, other = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    def prompt(seed):
        return [(seed * 7919 + i * 31) % 360 + 3 for i in range(200)]
    llm = LLM(model=model, num_kv_blocks=40, kv_store=KVStoreConfig(host_cache_gib=0.01, shared_path=str(shared)))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    mine = llm.generate([prompt(me)], sp)[0].outputs[0].token_ids
    llm.engine.kv_connector.store.flush(30)
    (shared / f"ready-{me}").write_text(json.dumps(mine))
    deadline = time.monotonic() + 60
    while not (shared / f"ready-{other}").exists():
        assert time.monotonic() < deadline, "the other engine never finished"
        time.sleep(0.05)
    # Concurrently: read the other's prefix while writing new ones of our own.
    outs = llm.generate([prompt(other), prompt(me + 100), prompt(me + 200)], sp)
    llm.engine.kv_connector.store.flush(30)
    stats = llm.engine.kv_store_stats()["tiers"]["shared"]
    print(json.dumps({"tokens": outs[0].outputs[0].token_ids, "cached": outs[0].num_cached_tokens,
                      "corrupt": stats["corrupt_reads"], "hits": stats["hits"]}))
    """
)


@pytest.mark.slow
def test_two_engine_processes_share_one_store(tiny_model: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "DEEPINFER_ACCELERATOR": "cpu",
        "DEEPINFER_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARER, str(tiny_model), str(tmp_path), str(me), str(other)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for me, other in ((1, 2), (2, 1))
    ]
    try:
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    written = {me: json.loads((tmp_path / f"ready-{me}").read_text()) for me in (1, 2)}
    for result, other in zip(results, (2, 1)):
        assert result["cached"] == 192 and result["hits"] >= 12
        assert result["corrupt"] == 0
        assert result["tokens"] == written[other]  # the other's prompt, served from its blocks


def test_blocks_copied_to_scattered_host_slots_come_back_whole(tiny_model: Path) -> None:
    """Device -> host copies go per run of consecutive slots; a scattered reservation (an evicting
    host tier hands out freed slots in any order) must land every block in its own slot."""
    connector = make(tiny_model).engine.kv_connector
    caches = connector.kv_caches
    for layer in caches:
        for tensor in layer:
            tensor.copy_(torch.randn_like(tensor))
    blocks, slots = [3, 7, 8, 1, 20], [9, 2, 3, 4, 0]  # runs: [9], [2, 3, 4], [0]
    connector._copy_out(blocks, slots)
    before = [[tensor[blocks].clone() for tensor in layer] for layer in caches]
    for layer in caches:
        for tensor in layer:
            tensor.zero_()
    connector._copy_in(slots, blocks)
    for layer, saved in zip(caches, before):
        for tensor, rows in zip(layer, saved):
            assert torch.equal(tensor[blocks], rows)
