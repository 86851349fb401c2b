"""Handoff orders (``kv_transfer``) at a worker come only from a router: without the cluster key they
are refused (403 naming ``kv_transfer``, in the API's error shape), and an order's times must be
finite and its lease bounded (400 naming the field), so no client can pin KV blocks in the store
(issue 34, defect 4). A real server (``deepinfer serve``'s app on loopback) with a cluster secret and
no KV store: an order that passes the checks gets as far as the worker's role and store check."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepinfer.core.roles import Role
from deepinfer.kvstore.config import KVStoreConfig
from deepinfer.web.auth import CLUSTER_KEY_HEADER
from deepinfer.web.handoff import MAX_LEASE_S
from tests.server.conftest import MODEL_NAME, ServerHandle, start_server

SECRET = "s3cret-for-the-tests-0123456789"
BODY = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed(deepseek_model: Path) -> Iterator[ServerHandle]:
    yield from start_server(deepseek_model, cluster_secret=SECRET)


def order(**changes) -> dict:
    return {"handoff_id": "h-1", "deadline_unix": time.time() + 60, "lease_s": 5.0, **changes}


def post(
    url: str, kv_transfer: dict, key: str | None = None, path: str = "/v1/completions"
) -> httpx.Response:
    headers = {CLUSTER_KEY_HEADER: key} if key is not None else {}
    body = {**BODY, "kv_transfer": kv_transfer}
    if path == "/v1/messages":
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "kv_transfer": kv_transfer}  # fmt: skip
    # json.dumps writes NaN and Infinity as Python's json.loads (and a worker's) reads them
    raw = json.dumps(body).encode()
    return httpx.post(
        f"{url}{path}", content=raw, headers={**headers, "content-type": "application/json"}, timeout=30
    )


def test_an_order_without_the_cluster_key_is_refused(keyed: ServerHandle) -> None:
    for key in (None, "", "not-the-secret-0123456789"):
        r = post(keyed.url, order(lease_s=1e9), key)
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["param"] == "kv_transfer" and "x-deepinfer-cluster-key" in error["message"]
    r = post(keyed.url, order(), path="/v1/messages")
    assert r.status_code == 403 and r.json()["type"] == "error"  # Anthropic's shape
    assert r.json()["error"]["type"] == "permission_error"
    assert "kv_transfer" in r.json()["error"]["message"]
    # the same body without the order is served as usual
    assert httpx.post(f"{keyed.url}/v1/completions", json=BODY, timeout=60).status_code == 200


def test_a_worker_without_a_cluster_secret_takes_no_orders(server: ServerHandle) -> None:
    r = post(server.url, order(), "anything-at-all-0123456789")
    assert r.status_code == 403
    assert "no cluster secret" in r.json()["error"]["message"]


def test_lease_and_times_must_be_finite_and_bounded(keyed: ServerHandle) -> None:
    bad = {
        "lease_s": [1e9, float("nan"), float("inf"), 0.0, -1.0, MAX_LEASE_S + 1],
        "deadline_unix": [float("nan"), float("inf")],
    }
    for name, values in bad.items():
        for value in values:
            r = post(keyed.url, order(**{name: value}), SECRET)
            assert r.status_code == 400, (name, value, r.text)
            assert r.json()["error"]["param"] == f"kv_transfer.{name}", r.text
    decode = {**order(), "first_token_id": 1, "block_keys": [], "num_prompt_tokens": 4, "num_cached_tokens": 9,
              "kv_layout": "L", "lease_expires_unix": float("nan")}  # fmt: skip
    r = post(keyed.url, decode, SECRET)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer.lease_expires_unix"
    r = post(keyed.url, {**decode, "lease_expires_unix": time.time() + 5}, SECRET)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer.num_cached_tokens"
    # a valid order, with the key, passes these checks: this worker has no shared store for it
    r = post(keyed.url, order(lease_s=MAX_LEASE_S), SECRET)
    assert r.status_code == 409 and "no shared KV store" in r.json()["error"]["message"]


def test_a_deeply_nested_body_with_an_order_is_a_400(keyed: ServerHandle) -> None:
    raw = b'{"kv_transfer": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{keyed.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text


@pytest.fixture(scope="module")
def both(deepseek_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """A both-role worker with a shared KV store: it takes prefill and decode orders."""
    store = KVStoreConfig(host_cache_gib=0.01, shared_path=str(tmp_path_factory.mktemp("shared-store")))
    yield from start_server(deepseek_model, engine={"kv_store": store}, cluster_secret=SECRET, role=Role.BOTH)


def bodies(text: str) -> dict[str, dict]:
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return {"/v1/chat/completions": chat, "/v1/messages": chat, "/v1/completions": {**BODY, "prompt": text}}


def cached_of(path: str, answer: dict) -> tuple[int, int]:
    """``(prompt tokens, cached prompt tokens)`` of an answer's usage, in its API's terms."""
    u = answer["usage"]
    if path == "/v1/messages":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def handed_off(url: str, path: str, body: dict, handoff_id: str) -> tuple[dict, dict]:
    """The router's two hops by hand on one worker: the prefill's kv_transfer result and the decode's answer."""
    key = {CLUSTER_KEY_HEADER: SECRET}
    prefill = httpx.post(f"{url}{path}", json={**body, "max_tokens": 1, "kv_transfer": order(handoff_id=handoff_id)},
                         headers=key, timeout=60)  # fmt: skip
    assert prefill.status_code == 200, prefill.text
    result = prefill.json()["kv_transfer"]
    decode = {k: v for k, v in result.items() if k != "handoff_id"} | {"handoff_id": handoff_id,
              "deadline_unix": time.time() + 60}  # fmt: skip
    answer = httpx.post(f"{url}{path}", json={**body, "kv_transfer": decode}, headers=key, timeout=60)
    assert answer.status_code == 200, answer.text
    return result, answer.json()


def test_a_decode_reports_the_prefills_cache_hits_not_the_handed_off_blocks(both: ServerHandle) -> None:
    """Issue 34, defect 7: the decode side found every handed-off block cached (here in its own prefix
    cache: it computed them as the prefill), yet the client is billed for none of a new prompt's tokens
    as cached; a repeated prompt reports the prefill's true hits."""
    for i, path in enumerate(bodies("")):
        body = bodies(f"# request {i} is new\n" + "def handler(request):\n    return request.body\n" * 6)[
            path
        ]
        result, answer = handed_off(both.url, path, body, f"cold-{i}")
        tokens, cached = cached_of(path, answer)
        assert result["num_cached_tokens"] == 0 and tokens > 48 and cached == 0, (path, answer["usage"])
        result, answer = handed_off(both.url, path, body, f"warm-{i}")
        tokens, cached = cached_of(path, answer)
        assert 0 < result["num_cached_tokens"] < tokens and cached == result["num_cached_tokens"], (
            path,
            answer,
        )
