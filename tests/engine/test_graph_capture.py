"""Decode steps through the graph-capture path (the CPU platform's wrapper re-runs eagerly) give the
eager outputs, with padded batch sizes and a reserved padding block."""

from __future__ import annotations

from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.worker.graphs import padded_sizes


def test_padded_sizes() -> None:
    assert padded_sizes(1) == [1]
    assert padded_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_graph_decode_matches_eager(tiny_model: Path) -> None:
    prompts = [[(7 * i + j) % 300 + 2 for j in range(5 + 11 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=20, ignore_eos=True)
    eager = LLM(str(tiny_model), num_kv_blocks=64, max_num_seqs=8).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    llm = LLM(str(tiny_model), num_kv_blocks=64, max_num_seqs=8, graph_capture=True)
    graphed = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    graphs = llm.engine.runner.graphs
    assert set(graphs.graphs) <= set(graphs.sizes) and 8 in graphs.graphs  # 5 requests pad to 8
    assert llm.engine.kv_cache.num_free_blocks == 64  # the padding block is not the manager's
