"""The registry against scripted workers (httpx's MockTransport): startup checks, ejection after
failed polls, re-admission, registration."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from deepinfer.core.roles import Role
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.registry import Registry, WorkerRejected
from tests.router.test_policies import report


class Workers:
    """Scripted /load answers per host: a WorkerLoad, or an exception to raise."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        answer = self.answers.get(request.url.host)
        if answer is None or isinstance(answer, Exception):
            raise answer or httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, content=msgspec.json.encode(answer))


def load(role: Role = Role.BOTH, **changes):
    return msgspec.structs.replace(report(), role=role, **changes)


def registry(workers: Workers, client: httpx.AsyncClient, eject_after: int = 2) -> Registry:
    return Registry(client, RouterMetrics(), 0.01, 1.0, eject_after, "f", "--model test")


def run(coro):
    return asyncio.run(coro)


def test_startup_checks_name_the_option() -> None:
    workers = Workers()
    workers.answers = {"d": load(Role.DECODE), "b": load(), "m": load(model="other"), "k": load(kv_layout="x"),
                       "t": load(model_fingerprint="g")}  # fmt: skip

    async def check(named: dict[str, str]) -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(workers.handler)) as client:
            with pytest.raises(WorkerRejected) as info:
                await registry(workers, client).add_configured(named, timeout_s=0.3)
            return str(info.value)

    assert run(check({"http://d": "--prefill"})).startswith(
        "--prefill http://d: the worker there has role decode"
    )
    assert "--both http://m: the worker serves model 'other', --decode http://d serves 'm'" in run(
        check({"http://d": "--decode", "http://m": "--both"})
    )
    assert "--both http://k: the worker's KV layout x differs from --decode http://d's k" in run(
        check({"http://d": "--decode", "http://k": "--both"})
    )
    assert "another model or tokenizer than the router's --model test" in run(check({"http://t": "--both"}))
    assert run(check({"http://gone": "--decode"})).startswith("--decode http://gone: no worker answers there")


def test_ejection_readmission_and_registration() -> None:
    workers = Workers()
    workers.answers = {"a": load(), "b": load(Role.DECODE)}

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(workers.handler)) as client:
            reg = registry(workers, client)
            await reg.add_configured({"http://a": "--both"}, timeout_s=1)
            poller = asyncio.create_task(reg.poll_forever())
            try:
                ejected = reg.ejected("http://a")
                workers.answers["a"] = httpx.ReadTimeout("slow")
                await asyncio.wait_for(ejected.wait(), 2)  # two failed polls
                assert not reg.admitted("http://a") and not reg.book.view("http://a").admitted
                workers.answers["a"] = load()
                for _ in range(200):
                    if reg.admitted("http://a"):
                        break
                    await asyncio.sleep(0.01)
                assert reg.admitted("http://a") and not reg.ejected("http://a").is_set()
                workers.answers["a"] = load(healthy=False)  # a worker that says it is unhealthy
                await asyncio.wait_for(reg.ejected("http://a").wait(), 2)
                assert (await reg.add("http://b", "registration")).role is Role.DECODE
                assert reg.status()["http://b"] == {
                    "role": "decode",
                    "admitted": True,
                    "source": "registration",
                }
                with pytest.raises(WorkerRejected, match="registration of http://c: no worker answers"):
                    await reg.add("http://c", "registration")
            finally:
                poller.cancel()

    run(scenario())


def test_a_dead_registered_worker_is_forgotten_and_a_named_one_only_ejected() -> None:
    """Issue 34, defect 1: a worker that registered itself and stays ejected for
    ``deregister_after_s`` is forgotten (so ``/health`` is ok again); one named on the command line
    stays, ejected. A worker may leave at once (``remove``), one named on the command line may not."""
    workers = Workers()
    workers.answers = {"a": load(), "r": load(Role.DECODE), "s": load()}

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(workers.handler)) as client:
            reg = Registry(client, RouterMetrics(), 0.01, 1.0, 2, "f", "--model test", deregister_after_s=0.2)
            await reg.add_configured({"http://a": "--both"}, timeout_s=1)
            await reg.add("http://r", "registration")
            await reg.add("http://s", "registration")
            assert reg.registered("http://r") and not reg.registered("http://a")
            poller = asyncio.create_task(reg.poll_forever())
            try:
                workers.answers["a"] = workers.answers["r"] = httpx.ConnectError("refused")
                waiting = reg.ejected("http://r")
                await asyncio.wait_for(waiting.wait(), 2)
                for _ in range(300):  # bounded: 3 s
                    if "http://r" not in reg.status():
                        break
                    await asyncio.sleep(0.01)
                assert set(reg.status()) == {"http://a", "http://s"}
                assert "http://r" not in reg.book and reg.ejected("http://r").is_set()
                assert not reg.admitted("http://a")  # ejected, never forgotten
                await asyncio.sleep(0.3)
                assert "http://a" in reg.status()
                reg.remove("http://s", "it deregistered")
                assert set(reg.status()) == {"http://a"} and "http://s" not in reg.book
                with pytest.raises(ValueError, match="named on the command line"):
                    reg.remove("http://a", "asked")
                reg.remove("http://gone", "asked")  # idempotent
            finally:
                poller.cancel()

    run(scenario())


def test_a_worker_that_refuses_the_load_poll_names_the_cluster_secret() -> None:
    """Issue 34, defect 2: a router without the workers' cluster secret fails at startup with a
    line naming the options that give it, not a retry until the timeout."""

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "needs the cluster key"}})

    async def check() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            with pytest.raises(WorkerRejected) as info:
                await registry(Workers(), client).add_configured({"http://k": "--decode"}, timeout_s=30)
            return str(info.value)

    message = run(check())
    assert message.startswith("--decode http://k: the worker refused the router's load poll (401)")
    assert "--cluster-secret-file PATH or DEEPINFER_CLUSTER_SECRET" in message
