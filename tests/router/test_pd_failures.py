"""Failures of the prefill->decode handoff with real processes on loopback (``deepinfer cluster``):

- a decode worker stopped (SIGSTOP) before it pulls: the prefill worker's lease expires and it
  frees the blocks (its ``/load`` lease count and its expiry counter say so);
- the prefill worker killed (SIGKILL) under load: every request still completes (the decode worker
  computes the prompt itself);
- 200 requests with injected failures (clients that leave mid-stream, invalid requests, a decode
  worker stopped for a while): afterwards every worker holds no KV and the store's lease table is empty;
- a decode worker killed (SIGKILL) under load: a request that had streamed nothing is retried on the
  other decode worker, a stream that had output ends with an error event.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.router.cluster import Cluster, running_cluster, worker_load, worker_metric
from tests.router.test_router_e2e import LONG, MODEL


def prompt(i: int) -> str:
    return f"{LONG}\n    value_{i} = {i} * 2\n"  # 2+ blocks of 16 tokens: takes the two-hop path


def complete(base: str, i: int, max_tokens: int = 16, timeout: float = 120) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def stream(base: str, i: int, max_tokens: int = 48, leave_after: int | None = None) -> list[dict | str]:
    """A streamed chat request's events (``leave_after``: disconnect after that many)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    events: list[dict | str] = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if leave_after is not None and len(events) >= leave_after:
                    break
    return events


def has_output(events: list[dict | str]) -> bool:
    return any(
        isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content") for e in events
    )


def errored(events: list[dict | str]) -> bool:
    return any(isinstance(e, dict) and "error" in e for e in events)


def lease_files(c: Cluster) -> list[Path]:
    return list((Path(c.log).parent / "store" / "leases").glob("*.lease"))


@pytest.mark.slow
def test_lease_expiry_then_prefill_killed_under_load(tmp_path: Path) -> None:
    # a 1 s lease, shorter than the ~4 s the router takes to eject a stopped worker
    with running_cluster(tmp_path, "--prefill", "1", "--decode", "1", "--min-disaggregated-tokens", "16",
                         "--kv-lease-s", "1") as c:  # fmt: skip
        (p,), (d,) = c.workers_of("prefill"), c.workers_of("decode")
        _stopped_decode_lets_the_lease_expire(c, p, d)
        _prefill_killed_under_load(c, p, d)


def _stopped_decode_lets_the_lease_expire(c: Cluster, p: str, d: str) -> None:
    pid = c.workers[d]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, c.url, 0)
            c.wait_for(
                lambda: worker_metric(p, "deepinfer_kv_handoff_prefills_total") == 1, 30, "the prefill"
            )
            c.wait_for(
                lambda: worker_metric(p, "deepinfer_kv_handoff_expired_total") == 1, 10, "lease expiry"
            )
            assert worker_load(p)["kv_leases"] == 0 and lease_files(c) == []
            assert worker_metric(p, "deepinfer_kv_handoff_released_total") == 0  # expired, not released
            # the router gives up on the stopped worker (no other can decode): an error, not a hang
            assert answer.result(timeout=60).status_code in (502, 503, 504)
        assert c.metric('deepinfer_router_handoffs_total{outcome="expired"}') == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    c.wait_for(lambda: c.health()["status"] == "ok", 30, "re-admission of the decode worker")
    assert complete(c.url, 1).status_code == 200


def _prefill_killed_under_load(c: Cluster, p: str, d: str) -> None:
    done = worker_metric(p, "deepinfer_kv_handoff_prefills_total")
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, c.url, 10 + i, 24) for i in range(16)]
        c.wait_for(
            lambda: worker_metric(p, "deepinfer_kv_handoff_prefills_total") >= done + 2, 60, "prefills"
        )
        os.kill(c.workers[p]["pid"], signal.SIGKILL)
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 16, [r.text[:200] for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in responses)
    assert c.metric('deepinfer_router_requests_total{api="completions",outcome="ok",path="long"}') > 0
    assert c.metric('deepinfer_router_requests_total{api="completions",outcome="ok",path="two_hop"}') > 0


@pytest.mark.slow
def test_injected_failures_leave_nothing_held_then_decode_killed(tmp_path: Path) -> None:
    with running_cluster(tmp_path, "--prefill", "1", "--decode", "2", "--min-disaggregated-tokens", "16",
                         "--kv-lease-s", "5", "--poll-timeout-s", "1") as c:  # fmt: skip
        _two_hundred_with_failures(c)
        _decode_killed_under_load(c)


def _two_hundred_with_failures(c: Cluster) -> None:
    d1 = c.workers_of("decode")[0]
    rng = random.Random(0)
    kinds = [rng.choice(["plain", "plain", "stream", "leave", "bad"]) for _ in range(200)]

    def one(i: int) -> str:
        kind = kinds[i]
        if kind == "plain":
            return "ok" if complete(c.url, i, 8).status_code == 200 else "error"
        if kind == "bad":  # invalid for the prefill worker: its 400 is the client's answer
            body = {"model": MODEL, "prompt": prompt(i), "max_tokens": 8, "temperature": -1}
            return (
                "bad"
                if httpx.post(f"{c.url}/v1/completions", json=body, timeout=60).status_code == 400
                else "?"
            )
        events = stream(c.url, i, 16, leave_after=2 if kind == "leave" else None)
        return "left" if kind == "leave" else ("ok" if has_output(events) else "error")

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(200)]
        time.sleep(5)
        os.kill(c.workers[d1]["pid"], signal.SIGSTOP)  # ejected, its handoffs retried or failed
        time.sleep(4)
        os.kill(c.workers[d1]["pid"], signal.SIGCONT)
        outcomes = [f.result() for f in futures]
    assert outcomes.count("bad") == kinds.count("bad") and "?" not in outcomes
    assert outcomes.count("ok") + outcomes.count("error") + outcomes.count("left") == 200 - kinds.count("bad")
    assert outcomes.count("ok") >= 100, outcomes
    c.wait_for(lambda: c.health()["status"] == "ok", 30, "every worker admitted")

    def settled() -> bool:
        loads = [worker_load(url) for url in c.workers]
        return all(
            ld["engine"]["kv_tokens_held"] == 0 and ld["engine"]["num_running"] == 0 and ld["num_in_flight"] == 0
            and ld["kv_leases"] == 0 for ld in loads
        ) and not lease_files(c)  # fmt: skip

    c.wait_for(settled, 30, "no KV held and no lease left")
    for url in c.workers:
        assert worker_metric(url, "deepinfer_kv_cache_usage_ratio") == 0.0
    assert c.metric('deepinfer_router_handoffs_total{outcome="done"}') >= 100


def _decode_killed_under_load(c: Cluster) -> None:
    d1, _ = c.workers_of("decode")
    pid = c.workers[d1]["pid"]
    retries = c.metric("deepinfer_router_retries_total")
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(stream, c.url, 300 + i, 64) for i in range(6)]
        c.wait_for(
            lambda: worker_load(d1)["engine"]["num_running"] >= 1, 60, "streams on the first decode worker"
        )
        os.kill(pid, signal.SIGSTOP)  # requests handed to it now stream nothing until it is killed
        futures += [pool.submit(stream, c.url, 400 + i, 16) for i in range(6)]
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    broken = [r for r in results if errored(r)]
    assert broken, "a stream on the killed worker had output: it must end with an error event"
    for events in broken:  # only a stream that had output ends with an error (then [DONE])
        first_error = next(i for i, e in enumerate(events) if isinstance(e, dict) and "error" in e)
        assert has_output(events[:first_error]) and events[-1] == "[DONE]"
    for events in results:  # every other one completed, retried elsewhere if it had to be
        if not errored(events):
            assert has_output(events) and events[-1] == "[DONE]"
    assert c.metric('deepinfer_router_failures_total{kind="mid_stream"}') >= len(broken)
    assert c.metric("deepinfer_router_retries_total") > retries
