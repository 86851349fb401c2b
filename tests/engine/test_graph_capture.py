"""Decode steps through the graph-capture path give the eager outputs: on the CPU (fast backend) by
replaying recorded ops for every exact batch size, on by default; and with padded batch sizes and a
reserved padding block, as devices capture them."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.backends.cpu.graph import CpuGraph
from deepinfer.platform.cpu import CpuPlatform
from deepinfer.platform.interface import Platform

PROMPTS = [[(7 * i + j) % 300 + 2 for j in range(5 + 11 * i)] for i in range(5)]
PARAMS = [
    SamplingParams(temperature=0.7, seed=4, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
]


def _eager(tiny_model: Path) -> list[list[list[int]]]:
    llm = LLM(str(tiny_model), num_kv_blocks=64, max_num_seqs=8, graph_capture=False)
    assert llm.engine.runner.graphs is None
    return [[o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=p)] for p in PARAMS]


def test_cpu_graphs_are_on_by_default_and_match_eager(tiny_model: Path) -> None:
    eager = _eager(tiny_model)
    llm = LLM(str(tiny_model), num_kv_blocks=64, max_num_seqs=8)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == list(range(1, 9))  # every size: nothing padded
    graphed = [
        [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=p)] for p in PARAMS
    ]
    assert graphed == eager
    assert 5 in graphs.graphs and all(isinstance(g, CpuGraph) for g, _, _ in graphs.graphs.values())
    assert llm.engine.kv_cache.num_free_blocks == 64  # the padding block is not the manager's


def test_padded_graph_sizes_match_eager(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Powers of two, as a device pads: 5 requests replay the graph of 8, whose 3 padding rows write
    only the reserved block."""
    eager = _eager(tiny_model)
    monkeypatch.setattr(CpuPlatform, "graph_batch_sizes", Platform.graph_batch_sizes)
    llm = LLM(str(tiny_model), num_kv_blocks=64, max_num_seqs=8, graph_capture=True)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8]
    graphed = [
        [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=p)] for p in PARAMS
    ]
    assert graphed == eager
    assert 8 in graphs.graphs and 5 not in graphs.graphs
    assert llm.engine.kv_cache.num_free_blocks == 64


def test_graph_sizes_are_checked() -> None:
    from deepinfer.worker.graphs import DecodeGraphs

    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs(None, [], CpuGraph, [4, 2], 8, 16, 0, "cpu")  # type: ignore[arg-type]


def test_a_forward_that_cannot_be_captured_runs_eagerly(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deterministic mode's grouped expert products size their padding on the host: graphs are off by
    default there, and asked for anyway they are refused at the first capture, with a warning naming the
    op, and every step runs eagerly with the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kwargs = {"num_kv_blocks": 64, "max_num_seqs": 8, "deterministic": True}
    assert LLM(str(tiny_model), **kwargs).engine.runner.graphs is None
    eager = LLM(str(tiny_model), graph_capture=False, **kwargs).generate(
        prompt_token_ids=PROMPTS, sampling_params=params
    )
    llm = LLM(str(tiny_model), graph_capture=True, **kwargs)
    with caplog.at_level("WARNING"):
        out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in out] == [o.token_ids for o in eager]
    graphs = llm.engine.runner.graphs
    assert graphs.refused and not graphs.graphs
    assert any("decode graphs off" in r.message for r in caplog.records)


def test_an_engines_graphs_share_one_memory_pool(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch size's graph is captured into the one pool the platform gave the engine (on devices
    a ``graph_pool_handle()``), so together they hold about what the largest needs."""
    pool, pools = object(), []
    make = CpuPlatform.graph

    def recording(self: CpuPlatform, pool: object = None) -> object:
        pools.append(pool)
        return make(self, pool)

    monkeypatch.setattr(CpuPlatform, "graph_pool", lambda self: pool)
    monkeypatch.setattr(CpuPlatform, "graph", recording)
    llm = LLM(str(tiny_model), num_kv_blocks=64, max_num_seqs=8)
    staggered = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(5)]
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=staggered)
    assert len(pools) == 5 and all(p is pool for p in pools)  # sizes 5 down to 1 as requests finish
