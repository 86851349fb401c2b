"""The router in front of two real workers (``deepinfer cluster --both 1 --decode 1``): the official
OpenAI and Anthropic clients, plain and streaming, on all four APIs, get what a single
``deepinfer serve`` (one of the workers, asked directly) answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.cluster import Cluster, running_cluster

MODEL = "deepinfer-tiny-coder"
SHORT = "def add(a, b):"
LONG = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n\n\ndef main():"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # prompts of 16+ tokens take the "long" path (the both-role worker), shorter ones the decode policy
    with running_cluster(tmp_path_factory.mktemp("cluster"), "--both", "1", "--decode", "1",
                         "--min-disaggregated-tokens", "16") as c:  # fmt: skip
        yield c


def clients(base: str):
    import anthropic
    import openai

    return (
        openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120),
        anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120),
    )


def answers(base: str, prompt: str) -> dict[str, str]:
    """Greedy answers of every API, plain and streamed, from the server at ``base``."""
    oa, an = clients(base)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 12,
        "temperature": 0,
    }
    out = {"chat": oa.chat.completions.create(**chat).choices[0].message.content}
    out["chat-stream"] = "".join(
        c.choices[0].delta.content or "" for c in oa.chat.completions.create(**chat, stream=True) if c.choices
    )
    comp = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    out["completions"] = oa.completions.create(**comp).choices[0].text
    out["completions-stream"] = "".join(
        c.choices[0].text for c in oa.completions.create(**comp, stream=True) if c.choices
    )
    resp = {"model": MODEL, "input": prompt, "max_output_tokens": 12, "temperature": 0}
    out["responses"] = oa.responses.create(**resp).output_text
    out["responses-stream"] = "".join(
        e.delta for e in oa.responses.create(**resp, stream=True) if e.type == "response.output_text.delta"
    )
    msg = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
           "extra_body": {"temperature": 0}}  # fmt: skip
    out["messages"] = "".join(b.text for b in an.messages.create(**msg).content if b.type == "text")
    with an.messages.stream(**msg) as stream:
        out["messages-stream"] = stream.get_final_text()
    return out


def test_all_apis_through_the_router_match_a_single_server(cluster: Cluster) -> None:
    both, decode = cluster.workers_of("both")[0], cluster.workers_of("decode")[0]
    assert httpx.get(f"{both}/health").json()["role"] == "both"
    assert 'deepinfer_worker_role{role="decode"} 1.0' in httpx.get(f"{decode}/metrics").text
    for prompt in (SHORT, LONG):
        direct = answers(both, prompt)
        assert all(direct.values()), direct
        assert direct["chat"] == direct["chat-stream"] and direct["messages"] == direct["messages-stream"]
        assert answers(cluster.url, prompt) == direct
    short = cluster.metric('deepinfer_router_requests_total{api="chat",outcome="ok",path="short"}')
    long = cluster.metric('deepinfer_router_requests_total{api="chat",outcome="ok",path="long"}')
    assert short >= 2 and long >= 2


def test_usage_errors_and_operational_routes(cluster: Cluster) -> None:
    import anthropic
    import openai

    oa, an = clients(cluster.url)
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=4)
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oa.chat.completions.create(model="other", messages=[{"role": "user", "content": SHORT}], max_tokens=4)
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model=MODEL, messages=[], max_tokens=4)
    bad = httpx.post(
        f"{cluster.url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert [m.id for m in oa.models.list()] == [MODEL]
    # issue 34, defect 6: relayed to a worker, errors in the API's shape (they were FastAPI's 404)
    assert oa.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("other")
    missing = httpx.get(f"{cluster.url}/v1/models/other", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # issue 35: Anthropic's model shapes (anthropic-version is relayed), HEAD /metrics
    page = an.models.list()
    assert [(m.type, m.id) for m in page.data] == [("model", MODEL)] and page.last_id == MODEL
    head = httpx.head(f"{cluster.url}/metrics", timeout=30)
    assert head.status_code == 200 and head.content == b""
    counted = an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": SHORT}])
    assert counted.input_tokens > 0
    bad = httpx.post(f"{cluster.url}/v1/messages/count_tokens", json={"model": MODEL}, timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as streamed:
        assert streamed.headers["x-deepinfer-worker"] in cluster.workers
        assert list(streamed.iter_lines())[-2:] == ["data: [DONE]", ""]
    workers = httpx.get(f"{cluster.url}/router/workers").json()
    assert {w["role"] for w in workers.values()} == {"both", "decode"} and all(
        w["admitted"] for w in workers.values()
    )
    assert all(w["busy_s"] > 0 for w in workers.values())


def test_bad_configuration_is_one_line_naming_the_option(tmp_path: Path) -> None:
    import subprocess
    import sys

    def router(*args: str) -> str:
        cmd = [sys.executable, "-m", "deepinfer.cli", "router", "--startup-timeout-s", "0.5", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        return lines[0]

    assert "no workers: give --prefill, --decode or --both" in router()
    assert router("--decode", "http://127.0.0.1:9").startswith(
        "deepinfer router: --decode http://127.0.0.1:9: no worker answers"
    )
    assert "--prefill: prefill workers need a --decode or --both" in router("--prefill", "http://127.0.0.1:9")
    assert "--both: 'localhost:1' is not an http(s) URL" in router("--both", "localhost:1")
    cluster = subprocess.run([sys.executable, "-m", "deepinfer.cli", "cluster", "--prefill", "1", "--kv-store-path",
                              str(tmp_path)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cluster.returncode == 2 and "--decode/--both: the cluster needs" in cluster.stderr
    (tmp_path / "file").write_text("")
    cluster = subprocess.run([sys.executable, "-m", "deepinfer.cli", "cluster", "--both", "1", "--kv-store-path",
                              str(tmp_path / "file")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cluster.returncode == 2 and "--kv-store-path:" in cluster.stderr
    for roles in (("--decode", "1"), ("--prefill", "1", "--decode", "1")):  # no store for the handoff
        cluster = subprocess.run([sys.executable, "-m", "deepinfer.cli", "cluster", *roles], capture_output=True,
                                 text=True, timeout=60)  # fmt: skip
        assert cluster.returncode == 2 and len(cluster.stderr.strip().splitlines()) == 1, cluster.stderr
        assert (
            "--kv-store-path: a cluster with prefill or decode workers needs a shared KV store"
            in cluster.stderr
        )


def test_a_worker_registers_with_a_router_that_accepts_it_and_deregisters_when_it_stops(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Issue 34, defect 1: ``deepinfer cluster`` (registration off) refuses a worker that registers,
    asking nothing of its URL; a router with ``--accept-registrations`` and the cluster secret admits
    it, and forgets it when it stops (it deregisters), so ``/health`` is ``ok`` again."""
    import os
    import subprocess
    import sys

    from deepinfer.router.cluster import cli_process, free_port
    from deepinfer.web.auth import CLUSTER_KEY_HEADER, CLUSTER_SECRET_ENV
    from tests.router.cluster import cluster_secret
    from tests.router.test_trust import Listener

    secret = cluster_secret(cluster)  # the cluster's own, as a worker of its holds it
    with Listener() as rogue:
        refused = httpx.post(f"{cluster.url}/router/register", json={"url": rogue.url},
                             headers={CLUSTER_KEY_HEADER: secret}, timeout=30)  # fmt: skip
        assert refused.status_code == 403 and "registration is off" in refused.text
        assert rogue.connections == 0
    env = {**os.environ, CLUSTER_SECRET_ENV: secret}
    decode = cluster.workers_of("decode")[0]
    args = ["router", "--decode", decode, "--accept-registrations", "--log-level", "warning"]
    with cli_process(args, tmp_path / "router.log", "the router", 60, env) as router_url:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--role", "both", "--port", str(port), "--log-level",
               "warning", "--kv-cache-memory-gib", "0.25", "--register-with", router_url]  # fmt: skip
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env={**env, "OMP_NUM_THREADS": "1", "DEEPINFER_CPU_BACKEND": "reference"})  # fmt: skip
        routed = Cluster(router_url, tmp_path / "router.log")
        try:
            routed.wait_for(lambda: url in routed.health()["workers"], 120, "registration")
            assert routed.health()["workers"][url] == {
                "role": "both",
                "admitted": True,
                "source": "registration",
            }
            worker.terminate()
            worker.wait(timeout=60)
            assert url not in routed.health()["workers"]  # it deregistered before it exited
            assert routed.health()["status"] == "ok"
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def test_a_router_for_another_model_refuses_the_workers(cluster: Cluster, tmp_path: Path) -> None:
    import json
    import os
    import shutil
    import subprocess
    import sys

    from deepinfer.model_zoo import default_model_path
    from deepinfer.web.auth import CLUSTER_SECRET_ENV
    from tests.router.cluster import cluster_secret

    other = tmp_path / "other-model"
    shutil.copytree(
        default_model_path(), other, ignore=shutil.ignore_patterns("*.safetensors", "confidence_head")
    )
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    decode = cluster.workers_of("decode")[0]
    cmd = [sys.executable, "-m", "deepinfer.cli", "router", "--decode", decode, "--model", str(other)]
    env = {**os.environ, CLUSTER_SECRET_ENV: cluster_secret(cluster)}  # the cluster's: the poll is answered
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (
        f"--decode {decode}: the worker serves another model or tokenizer than the router's --model"
        in done.stderr
    )


def test_a_full_prefill_queue_answers_429_and_the_rest_complete(cluster: Cluster, tmp_path: Path) -> None:
    """Late binding: with a horizon no busy worker is under, a second long prompt waits in the router
    while the first is computed, and those beyond the queue's limit get 429 with Retry-After."""
    import os
    import random
    from concurrent.futures import ThreadPoolExecutor

    from deepinfer.router.cluster import cli_process
    from deepinfer.web.auth import CLUSTER_SECRET_ENV
    from tests.router.cluster import cluster_secret

    both, decode = cluster.workers_of("both")[0], cluster.workers_of("decode")[0]
    args = ["router", "--both", both, "--decode", decode, "--prefill-queue-limit", "1", "--prefill-horizon-s",
            "1e-6", "--min-disaggregated-tokens", "0", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, CLUSTER_SECRET_ENV: cluster_secret(cluster)}
    with cli_process(args, tmp_path / "router.log", "the router", 60, env) as url:
        rng = random.Random(0)

        def post(_: int) -> httpx.Response:
            prompt = [rng.randrange(100, 1000) for _ in range(1200)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(post, range(6)))
        rejected = [r for r in answers if r.status_code == 429]
        assert rejected and all(r.status_code in (200, 429) for r in answers), [r.text for r in answers]
        assert sum(r.status_code == 200 for r in answers) >= 2  # the first, and the one that waited
        assert rejected[0].headers["retry-after"] == "1"
        assert rejected[0].json()["error"]["type"] == "rate_limit_error"
        assert "prefill worker" in rejected[0].json()["error"]["message"]
        metrics = dict(
            line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
            if line and not line.startswith("#")
        )  # fmt: skip
        assert float(metrics['deepinfer_router_failures_total{kind="queue_full"}']) == len(rejected)
        assert float(metrics["deepinfer_router_prefill_queue_depth"]) == 0  # the waiting one left
        assert float(metrics["deepinfer_router_prefill_queued_total"]) >= 1  # 429 only once one waits
