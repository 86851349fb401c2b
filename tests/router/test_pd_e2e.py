"""The prefill->decode handoff end to end (``deepinfer cluster --prefill 1 --decode 1``): the official
OpenAI and Anthropic clients through the router, plain and streaming, on all four APIs, get what a
single ``deepinfer serve`` answers (greedy), every request of a long prompt takes two hops, the
decode worker loads the prompt's blocks from the shared store (cached tokens reported), and no lease
is left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.cluster import Cluster, plain_server, running_cluster, worker_load, worker_metric
from tests.router.test_router_e2e import LONG, MODEL, answers, clients


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd")
    with running_cluster(tmp, "--prefill", "1", "--decode", "1", "--min-disaggregated-tokens", "16") as c:
        yield c


def test_cached_tokens_are_reported_for_a_handed_off_prompt(pd: Cluster) -> None:
    c = pd
    before = c.metric('deepinfer_router_handoffs_total{outcome="done"}')
    oa, an = clients(c.url)
    prompt = LONG + "\n    config = read_config(sys.argv[1])\n    print(config)\n"  # new to both workers
    chat = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0
    )
    cached = chat.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < chat.usage.prompt_tokens  # the blocks loaded from the store; the tail computed
    decode = c.workers_of("decode")[0]
    assert worker_metric(decode, "deepinfer_kv_handoff_loaded_blocks_total") >= cached // 16
    msg = an.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        extra_body={"temperature": 0},
    )
    assert msg.usage.cache_read_input_tokens > 0
    assert c.metric('deepinfer_router_handoffs_total{outcome="done"}') == before + 2
    assert worker_load(c.workers_of("prefill")[0])["kv_leases"] == 0


@pytest.mark.slow
def test_all_apis_through_prefill_and_decode_match_a_single_server(pd: Cluster, tmp_path: Path) -> None:
    c = pd
    with plain_server(tmp_path) as single:
        _all_apis_match(c, single)


def _all_apis_match(c: Cluster, single: str) -> None:
    prefill, decode = c.workers_of("prefill")[0], c.workers_of("decode")[0]
    assert worker_load(prefill)["kv_store_id"] == worker_load(decode)["kv_store_id"] != ""
    assert worker_load(single)["kv_store_id"] == ""
    direct = answers(single, LONG)
    assert all(direct.values()), direct

    def two_hops() -> tuple[float, float]:
        ok = sum(
            c.metric(f'deepinfer_router_requests_total{{api="{api}",outcome="ok",path="two_hop"}}')
            for api in ("chat", "completions", "responses", "messages")
        )
        return ok, c.metric('deepinfer_router_handoffs_total{outcome="done"}')

    before = two_hops()
    assert answers(c.url, LONG) == direct
    assert [b - a for a, b in zip(before, two_hops())] == [8, 8]
    assert worker_metric(decode, "deepinfer_kv_handoff_loaded_blocks_total") > 0
    assert worker_metric(decode, "deepinfer_kv_handoff_recomputed_blocks_total") == 0
    assert worker_metric(decode, "deepinfer_kv_handoff_first_token_mismatches_total") == 0
    # the decode worker acked every lease: none left in the store's table
    assert worker_load(prefill)["kv_leases"] == 0
    assert not list((Path(c.log).parent / "store" / "leases").iterdir())
