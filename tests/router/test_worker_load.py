"""The worker's side: ``engine_load`` read from a real engine as a prompt is computed, and
``GET /load`` / ``/health`` / ``/metrics`` on a real server, and who may call its router-only routes
(``/load``, ``/kv/release``) with which credentials."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from deepinfer.config import EngineConfig
from deepinfer.core.load import LOAD_PATH, WorkerLoad, engine_load, model_fingerprint, step_cost_model
from deepinfer.core.roles import Role
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model_zoo import default_model_path
from deepinfer.sampling_params import SamplingParams
from deepinfer.web.auth import CLUSTER_KEY_HEADER
from tests.server.conftest import start_server

KEY, SECRET = "worker-api-key", "worker-cluster-secret-0123456789"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(default_model_path()), num_kv_blocks=64, max_num_batched_tokens=256)
    )


def test_engine_load_follows_a_prompt_through_the_engine(engine: LLMEngine) -> None:
    assert engine_load(engine, 0.0).prefill.tokens == 0
    prompt = list(range(100, 500))  # 400 tokens: two 256-token steps
    engine.add_request("r", None, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    queued = engine_load(engine, 0.0)
    assert (queued.num_waiting, queued.prefill.requests, queued.prefill.tokens) == (1, 1, 400)
    model = step_cost_model(engine)
    assert queued.prefill.seconds(model) == pytest.approx(model.marginal(400, 0))
    engine.step()
    half = engine_load(engine, 1.5)
    assert (half.num_running, half.prefill.tokens, half.kv_tokens_held, half.busy_s) == (1, 144, 256, 1.5)
    assert half.prefill.seconds(model) == pytest.approx(model.marginal(144, 256))
    while engine.has_unfinished_requests():
        engine.step()
    done = engine_load(engine, 2.0)
    assert (done.num_running, done.prefill.tokens, done.kv_tokens_held) == (0, 0, 0)
    assert done.kv_capacity_tokens == 64 * engine.kv_cache.block_size


def test_load_endpoint_health_and_role_metric() -> None:
    gen = start_server(default_model_path(), runner=lambda engine: None, role=Role.DECODE,
                       model_fingerprint=model_fingerprint(default_model_path()))  # fmt: skip
    handle = next(gen)
    try:
        load = msgspec.json.decode(httpx.get(f"{handle.url}{LOAD_PATH}").content, type=WorkerLoad)
        assert (load.role, load.healthy, load.model) == (Role.DECODE, True, "tiny-deepseek")
        assert load.model_fingerprint == model_fingerprint(default_model_path())
        assert len(load.kv_layout) == 16 and load.cost_model.source == "chip facts"
        assert httpx.get(f"{handle.url}/health").json()["role"] == "decode"
        assert 'deepinfer_worker_role{role="decode"} 1.0' in httpx.get(f"{handle.url}/metrics").text
        body = {"model": "tiny-deepseek", "prompt": list(range(100, 300)), "max_tokens": 3}
        assert httpx.post(f"{handle.url}/v1/completions", json=body, timeout=60).status_code == 200
        after = msgspec.json.decode(httpx.get(f"{handle.url}{LOAD_PATH}").content, type=WorkerLoad)
        assert after.engine.busy_s > 0 and after.num_in_flight == 0 and after.engine.prefill.tokens == 0
    finally:
        gen.close()


@pytest.mark.parametrize(
    ("api_key", "secret"),
    [(None, None), (KEY, None), (KEY, SECRET)],
    ids=["open", "api-key", "cluster-secret"],
)
def test_router_only_routes_need_the_cluster_key_or_the_api_key(
    api_key: str | None, secret: str | None
) -> None:
    """Issue 34, defect 3: ``GET /load`` (fingerprints, cost model, leases) and ``POST /kv/release``
    (state-changing) took no key. Now: with a cluster secret only the cluster key opens them (an API
    key is a 403); without one, the API key does; a worker with neither stays open (loopback behind a
    plain router). The cluster key opens the client routes too, in place of the API key."""
    gen = start_server(
        default_model_path(), runner=lambda engine: None, api_key=api_key, cluster_secret=secret
    )
    handle = next(gen)
    try:

        def ask(path: str, headers: dict[str, str]) -> int:
            if path == LOAD_PATH:
                return httpx.get(f"{handle.url}{path}", headers=headers, timeout=30).status_code
            body = {"handoff_id": "h-1"}
            return httpx.post(f"{handle.url}{path}", json=body, headers=headers, timeout=30).status_code

        bearer = {"Authorization": f"Bearer {KEY}"}
        cluster = {CLUSTER_KEY_HEADER: SECRET}
        for path in (LOAD_PATH, "/kv/release"):
            if api_key is None:
                assert ask(path, {}) == 200
                continue
            assert ask(path, {}) == 401
            assert ask(path, {"x-api-key": "wrong"}) in (401, 403)
            assert ask(path, bearer) == (403 if secret else 200)
            assert ask(path, cluster) == (200 if secret else 401)
        if secret is not None:
            refused = httpx.get(f"{handle.url}{LOAD_PATH}", headers=bearer, timeout=30).json()["error"]
            assert CLUSTER_KEY_HEADER in refused["message"] and "router only" in refused["message"]
            assert httpx.get(f"{handle.url}/v1/models", headers=cluster, timeout=30).status_code == 200
        if api_key is not None:
            assert httpx.get(f"{handle.url}/v1/models", timeout=30).status_code == 401
            assert httpx.get(f"{handle.url}/health", timeout=30).status_code == 200
    finally:
        gen.close()
