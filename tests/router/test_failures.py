"""Failures under load with real processes (two both-role workers behind the router): a stopped
worker is ejected and its waiting requests move to the other, then it is re-admitted; a worker killed
with SIGKILL mid-load: every non-streaming request still completes (through the other worker), a stream
that had output ends with an error event then [DONE], and every failure is counted."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.router.cluster import Cluster, running_cluster

MODEL = "deepinfer-tiny-coder"


def complete(base: str, i: int, max_tokens: int = 48) -> httpx.Response:
    body = {"model": MODEL, "prompt": f"def function_{i}(x):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def stream(base: str, i: int) -> list[str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"def g_{i}(y):"}], "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow
def test_stop_eject_readmit_and_kill_under_load(tmp_path: Path) -> None:
    with running_cluster(
        tmp_path, "--both", "2", "--poll-timeout-s", "1", "--min-disaggregated-tokens", "0"
    ) as c:
        a, b = c.workers_of("both")
        pid_a = c.workers[a]["pid"]
        _stop_then_resume(c, a, b, pid_a)
        _kill_under_load(c, a, b, pid_a)


def _stop_then_resume(c: Cluster, a: str, b: str, pid_a: int) -> None:
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, c.url, i) for i in range(8)]
        time.sleep(0.5)
        os.kill(pid_a, signal.SIGSTOP)
        try:
            c.wait_for(lambda: not c.health()["workers"][a]["admitted"], 15, "ejection of the stopped worker")
            assert c.health()["status"] == "degraded"
            responses = [f.result() for f in futures]  # those waiting on the stopped worker moved to b
        finally:
            os.kill(pid_a, signal.SIGCONT)
    assert [r.status_code for r in responses] == [200] * 8
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in responses)
    assert c.metric(f'deepinfer_router_ejections_total{{worker="{a}"}}') == 1
    c.wait_for(lambda: c.health()["status"] == "ok", 15, "re-admission")
    assert c.metric(f'deepinfer_router_readmissions_total{{worker="{a}"}}') == 1
    with ThreadPoolExecutor(6) as pool:  # at once: the router's own dispatches spread them
        served = {
            r.headers["x-deepinfer-worker"]
            for r in pool.map(lambda i: complete(c.url, 100 + i, 16), range(6))
        }
    assert served == {a, b}  # both take work again


def _kill_under_load(c: Cluster, a: str, b: str, pid_a: int) -> None:
    before = {
        k: c.metric(f'deepinfer_router_failures_total{{kind="{k}"}}') for k in ("connect", "mid_stream")
    }

    def timed_complete(i: int) -> tuple[httpx.Response, float]:
        response = complete(c.url, i, 384)
        return response, time.monotonic()

    with ThreadPoolExecutor(12) as pool:
        plain = [pool.submit(timed_complete, i) for i in range(8)]
        streams = [pool.submit(stream, c.url, i) for i in range(4)]
        time.sleep(1.5)
        os.kill(pid_a, signal.SIGKILL)
        killed_at = time.monotonic()
        responses = [f.result() for f in plain]
        events = [f.result() for f in streams]
    assert [r.status_code for r, _ in responses] == [200] * 8
    # a finished none after its death: what was in flight on a was retried on b
    late_from_a = [
        t - killed_at for r, t in responses if r.headers["x-deepinfer-worker"] == a and t > killed_at
    ]
    assert not late_from_a, f"responses from the killed worker after its death: {late_from_a}"
    assert any(r.headers["x-deepinfer-worker"] == b and t > killed_at for r, t in responses)
    for lines in events:
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        if "error" in last:  # it was streaming from a when a died
            assert last["error"]["type"] == "server_error" and "mid-stream" in last["error"]["message"]
        else:
            assert last["choices"] == [] or last["choices"][0]["finish_reason"] == "length"
    after = {k: c.metric(f'deepinfer_router_failures_total{{kind="{k}"}}') for k in before}
    broken = sum("error" in json.loads(lines[-2].removeprefix("data: ")) for lines in events)
    print(f"streams broken mid-stream: {broken} of {len(events)}; failures {after}")
    assert after["mid_stream"] - before["mid_stream"] == broken
    assert after["connect"] > before["connect"] or broken  # the kill was seen
    assert not c.health()["workers"][a]["admitted"] and c.health()["status"] == "degraded"
    assert complete(c.url, 999, 4).status_code == 200
