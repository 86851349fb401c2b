"""The prefill->decode handoff end to end (``deepinfer cluster --prefill 1 --decode 1``): the official
OpenAI and Anthropic clients through the router, plain and streaming, on all four APIs, get what a
single ``deepinfer serve`` answers (greedy), every request of a long prompt takes two hops, the
decode worker loads the prompt's blocks from the shared store, the usage reports as cached only the
prompt tokens the prefill worker found cached (never the blocks the handoff delivered), no lease is
left behind, and the workers take handoff orders only with the cluster key."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import pytest

from deepinfer.web.auth import CLUSTER_KEY_HEADER, CLUSTER_SECRET_ENV
from tests.router.cluster import Cluster, plain_server, running_cluster, worker_load, worker_metric
from tests.router.test_router_e2e import LONG, MODEL, answers, clients

# Batch-invariant workers: the cluster's answers are compared token for token with a single server's,
# and a prompt the prefill worker has partly cached (or a decode worker loads from the store) is chunked
# differently there, which by default may change logits in their last bits and flip a near-tie of the
# random model (seen once in CI: one streamed answer's first token).
DETERMINISTIC = {"DEEPINFER_DETERMINISTIC": "1"}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd")
    args = ("--prefill", "1", "--decode", "1", "--min-disaggregated-tokens", "16")
    with mock.patch.dict(os.environ, DETERMINISTIC), running_cluster(tmp, *args) as c:  # workers inherit it
        yield c


def cluster_key(c: Cluster) -> dict[str, str]:
    """The header that proves a request comes from the cluster's router: its secret, read from a
    worker's environment (``deepinfer cluster`` hands it to every process that way)."""
    pid = next(iter(c.workers.values()))["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    secret = next(v for k, _, v in (e.partition(b"=") for e in environ) if k == CLUSTER_SECRET_ENV.encode())
    return {CLUSTER_KEY_HEADER: secret.decode()}


def usage(c: Cluster, api: str, prompt: str) -> tuple[int, int]:
    """``(prompt tokens, cached prompt tokens)`` the client is told for a greedy request of ``api``
    through the router (the chat request streamed, its usage in the last chunk)."""
    oa, an = clients(c.url)
    if api == "messages":
        msg = an.messages.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                 extra_body={"temperature": 0})  # fmt: skip
        return msg.usage.input_tokens + msg.usage.cache_read_input_tokens, msg.usage.cache_read_input_tokens
    if api == "completions":
        got = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
    else:
        chunks = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                            temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
        (got,) = [chunk.usage for chunk in chunks if chunk.usage is not None]
    return got.prompt_tokens, got.prompt_tokens_details.cached_tokens


def test_a_cold_prompt_is_not_reported_cached_and_a_repeated_one_is(pd: Cluster) -> None:
    """A prompt new to the cluster is computed by the prefill worker: the blocks the decode worker
    loads from the store are no cache hits (users are billed by this field). Asked again, the
    prefill worker finds it in its prefix cache: those are reported."""
    c = pd
    done = c.metric('deepinfer_router_handoffs_total{outcome="done"}')
    decode = c.workers_of("decode")[0]
    loaded = worker_metric(decode, "deepinfer_kv_handoff_loaded_blocks_total")
    for api in ("chat", "completions", "messages"):
        prompt = f"# billed as computed: {api}\n" + LONG + "\n    config = read_config(sys.argv[1])\n"
        tokens, cached = usage(c, api, prompt)  # its first line is new to both workers
        assert tokens > 32 and cached == 0, (api, tokens, cached)
        again, hits = usage(c, api, prompt)
        assert again == tokens and 0 < hits < tokens, (api, again, hits)
    assert c.metric('deepinfer_router_handoffs_total{outcome="done"}') == done + 6  # every request: 2 hops
    assert worker_metric(decode, "deepinfer_kv_handoff_loaded_blocks_total") >= loaded + 3 * (32 // 16)
    assert worker_load(c.workers_of("prefill")[0])["kv_leases"] == 0


@pytest.mark.slow
def test_all_apis_through_prefill_and_decode_match_a_single_server(pd: Cluster, tmp_path: Path) -> None:
    c = pd
    with mock.patch.dict(os.environ, DETERMINISTIC), plain_server(tmp_path) as single:
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


def test_a_corrupt_block_in_the_store_is_recomputed_not_read(pd: Cluster) -> None:
    """The router's two hops by hand: a PrefillOrder to the prefill worker, one of the leased block
    files corrupted, then the DecodeOrder to the decode worker: the same greedy answer, the bad block
    and the ones after it counted as recomputed, the lease acked."""
    c = pd
    (p,), (d,) = c.workers_of("prefill"), c.workers_of("decode")
    # Its first line is its own: no other test leaves this prefix in a worker's prefix cache.
    text = (
        "# environment dump\n"
        + LONG
        + "\n    for key in sorted(os.environ):\n        print(key, os.environ[key])\n"
    )
    body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0}
    order = {"handoff_id": "corrupt-test", "deadline_unix": time.time() + 60, "lease_s": 30.0}
    key = cluster_key(c)
    r = httpx.post(f"{p}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer": order}, headers=key,
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    result = r.json()["kv_transfer"]
    keys = result["block_keys"]
    assert len(keys) >= 3 and result["handoff_id"] == "corrupt-test"
    assert worker_load(p)["kv_leases"] == 1
    store = Path(c.log).parent / "store"
    (bad,) = store.glob(f"kv1/*/{keys[1][:2]}/{keys[1]}.kvb")
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF  # payload bytes no longer match the record's checksum
    bad.write_bytes(bytes(raw))
    loaded = worker_metric(d, "deepinfer_kv_handoff_loaded_blocks_total")
    recomputed = worker_metric(d, "deepinfer_kv_handoff_recomputed_blocks_total")
    decode_order = {k: result[k] for k in ("handoff_id", "first_token_id", "block_keys", "num_prompt_tokens",
                                           "num_cached_tokens", "kv_layout", "lease_expires_unix")}  # fmt: skip
    decode_order["deadline_unix"] = order["deadline_unix"]
    got = httpx.post(
        f"{d}/v1/completions", json={**body, "kv_transfer": decode_order}, headers=key, timeout=60
    )
    assert got.status_code == 200, got.text
    expected = httpx.post(f"{p}/v1/completions", json=body, headers=key, timeout=60).json()["choices"][0][
        "text"
    ]
    assert got.json()["choices"][0]["text"] == expected
    # the usage counts what the prefill worker found cached (none: the prompt was new), not the loaded block
    assert result["num_cached_tokens"] == 0
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert worker_metric(d, "deepinfer_kv_handoff_loaded_blocks_total") == loaded + 1
    assert worker_metric(d, "deepinfer_kv_handoff_recomputed_blocks_total") == recomputed + len(keys) - 1
    assert worker_load(p)["kv_leases"] == 0  # the decode's ack
    again = httpx.post(f"{p}/kv/release", json={"handoff_id": "corrupt-test"}, headers=key, timeout=10)
    assert again.json() == {"released": False}  # idempotent


def test_orders_are_checked(pd: Cluster) -> None:
    c = pd
    (p,), (d,) = c.workers_of("prefill"), c.workers_of("decode")
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1}
    order = {"handoff_id": "x", "deadline_unix": time.time() + 60, "lease_s": 5.0}
    key = cluster_key(c)
    for url in (p, d):  # a client cannot hand out leases: only the router, with the cluster key
        pinned = httpx.post(f"{url}/v1/completions", json={**body, "kv_transfer": {**order, "lease_s": 1e9}})
        assert pinned.status_code == 403 and pinned.json()["error"]["param"] == "kv_transfer"
    assert not list((Path(c.log).parent / "store" / "leases").glob("x.lease"))
    long = httpx.post(
        f"{p}/v1/completions", json={**body, "kv_transfer": {**order, "lease_s": 1e9}}, headers=key
    )
    assert long.status_code == 400 and long.json()["error"]["param"] == "kv_transfer.lease_s"
    late = httpx.post(f"{p}/v1/completions", json={**body, "kv_transfer": {**order, "deadline_unix": 1.0}},
                      headers=key)  # fmt: skip
    assert late.status_code == 504 and "deadline" in late.json()["error"]["message"]
    bad = httpx.post(f"{p}/v1/completions", json={**body, "kv_transfer": {**order, "handoff_id": "../x"}},
                     headers=key)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer"
    wrong_side = httpx.post(f"{d}/v1/completions", json={**body, "kv_transfer": order}, headers=key)
    assert wrong_side.status_code == 409 and "does not prefill" in wrong_side.json()["error"]["message"]
    assert httpx.post(f"{p}/kv/release", json={"handoff_id": "a/b"}, headers=key).status_code == 400
