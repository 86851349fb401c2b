"""Late binding of prefills (``deepinfer.router.prefill_queue``) and the load book's slowdown: the
queue's order, bound, deadline and cancellation, and the estimated-compute policy over two simulated
workers, one of them slower than its cost model says, with the router's real load book and queue."""

from __future__ import annotations

import asyncio
import random

import pytest

from deepinfer.core.load import CostModel, EngineLoad, WorkerLoad
from deepinfer.core.roles import Role
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.router.balance import balance
from deepinfer.router.loadbook import LoadBook
from deepinfer.router.policies import EstimatedCompute, RequestInfo
from deepinfer.router.prefill_queue import PrefillQueue, QueueFull

MODEL = StepCostModel(1e-3, 1e-5, 1e-4, 1e-9, 0.0, "test")  # 1,000 prompt tokens: ~0.1 s


def idle_report(busy_s: float = 0.0) -> WorkerLoad:
    return WorkerLoad(
        model="m", model_fingerprint="f", kv_layout="k", role=Role.PREFILL, healthy=True, num_in_flight=0,
        engine=EngineLoad(kv_capacity_tokens=100_000, busy_s=busy_s), cost_model=CostModel.of(MODEL),
    )  # fmt: skip


def test_load_book_learns_each_workers_slowdown_from_its_engine_seconds() -> None:
    book = LoadBook()
    book.observe("a", idle_report(busy_s=5.0), requested_at=0.0)
    assert book.view("a").slowdown == 1.0  # nothing done yet
    book.dispatched("a", "r1", prefill_s=0.1, kv_tokens=10, now=1.0)
    book.dispatched("a", "r2", prefill_s=0.1, kv_tokens=10, now=1.0)
    book.prefilled("a", "r1", now=1.4)
    book.finished("a", "r2", now=1.7)  # a whole answer: its prompt was computed too
    # 0.6 engine seconds for 0.2 predicted; the HTTP and store time around them does not count
    book.observe("a", idle_report(busy_s=5.6), requested_at=2.0)
    assert book.view("a").slowdown == pytest.approx(3.0)
    book.dispatched("a", "r3", prefill_s=0.2, kv_tokens=10, now=2.0)
    assert book.view("a").expected_backlog_s == pytest.approx(0.6)
    book.observe("a", idle_report(busy_s=5.6), requested_at=2.25)  # an idle poll changes nothing
    assert book.view("a").slowdown == pytest.approx(3.0)
    book.prefilled("a", "r3", now=2.4)
    book.observe("a", idle_report(busy_s=5.8), requested_at=2.5)  # 0.2 s for 0.2: it sped up
    assert 1.0 < book.view("a").slowdown < 3.0
    book.observe("a", idle_report(busy_s=0.0), requested_at=3.0)  # restarted: no sample
    assert 1.0 < book.view("a").slowdown < 3.0
    book.observe("b", idle_report(), requested_at=3.0)
    assert book.view("b").slowdown == book.view("a").slowdown  # new: its peers' meanwhile
    book.set_admitted("a", False)
    book.set_admitted("a", True)  # back after an outage: it learns again
    assert book.view("a").slowdown == 1.0  # no peer knows its own


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_request_is_placed_at_once_when_the_queue_is_empty() -> None:
    async def main() -> None:
        waits = []
        queue = PrefillQueue(0.1, 4, 0.05, on_wait=lambda: waits.append(1))
        assert await queue.place(lambda: "w", cost_s=1.0, timeout_s=1.0) == "w"
        assert waits == [] and queue.depth == 0

    run(main())


def test_the_queue_is_bounded_times_out_and_forgets_cancelled_requests() -> None:
    async def main() -> None:
        queue = PrefillQueue(0.1, 2, 0.01)
        never = lambda: None  # noqa: E731  no worker is ever under the horizon
        with pytest.raises(TimeoutError):
            await queue.place(never, cost_s=0.0, timeout_s=0.05)
        assert queue.depth == 0
        waiting = [asyncio.create_task(queue.place(never, 0.0, 10.0)) for _ in range(2)]
        await asyncio.sleep(0.02)
        assert queue.depth == 2
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            await queue.place(never, 0.0, 10.0)
        for task in waiting:  # the clients went away
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert queue.depth == 0

    run(main())


def test_longer_prompts_go_first_by_as_much_as_their_expected_seconds() -> None:
    async def main() -> None:
        queue = PrefillQueue(0.1, 8, 1.0)
        free = {"slots": 0}
        order: list[str] = []

        def attempt(name: str):
            def take():
                if free["slots"] == 0:
                    return None
                free["slots"] -= 1
                order.append(name)
                return name

            return take

        tasks = []
        for name, cost in (("short-early", 0.0), ("long-late", 5.0), ("short-late", 0.0)):
            tasks.append(asyncio.create_task(queue.place(attempt(name), cost, 10.0)))
            await asyncio.sleep(0.01)
        for _ in tasks:
            free["slots"] += 1
            queue.kick()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        # the 5 s prompt counts as if it had arrived 5 s earlier; the short ones keep their order
        assert order == ["long-late", "short-early", "short-late"]

    run(main())


async def simulate(late: bool, speed: dict[str, float], lengths: list[int]) -> dict[str, float]:
    """Route ``lengths`` (a burst, all at once) over simulated prefill workers that take ``speed[url]``
    times their predicted seconds per prompt, one at a time; each worker's busy seconds."""
    book, policy = LoadBook(), EstimatedCompute()
    for url in speed:
        book.observe(url, idle_report(), requested_at=0.0)
    queue = PrefillQueue(horizon_s=0.01, limit=len(lengths), recheck_s=0.05)
    inbox = {url: asyncio.Queue() for url in speed}
    busy = dict.fromkeys(speed, 0.0)
    clock = asyncio.get_running_loop().time

    async def worker(url: str) -> None:
        while True:
            rid, cost, done = await inbox[url].get()
            await asyncio.sleep(speed[url] * cost)
            busy[url] += speed[url] * cost
            book.prefilled(url, rid, clock())
            book.finished(url, rid, clock())
            queue.kick()
            done.set()

    def attempt(rid: str, info: RequestInfo):
        chosen = policy.choose(info, book.views())
        if late and not queue.under_horizon(chosen.expected_backlog_s):
            return None
        cost = chosen.request_cost_s(info)
        book.dispatched(chosen.url, rid, cost, info.prompt_tokens, clock())
        return chosen.url, cost

    async def request(i: int, tokens: int) -> None:
        info = RequestInfo(tokens)
        url, cost = await queue.place(lambda: attempt(f"r{i}", info), MODEL.marginal(tokens, 0), 30.0)
        done = asyncio.Event()
        inbox[url].put_nowait((f"r{i}", cost, done))
        await done.wait()

    workers = [asyncio.create_task(worker(url)) for url in speed]
    try:
        await asyncio.gather(*(request(i, n) for i, n in enumerate(lengths)))
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return busy


def test_late_binding_keeps_balance_when_one_worker_is_slower_than_predicted() -> None:
    rng = random.Random(0)
    lengths = [min(2000, int(50 / (1.0 - rng.random()) ** (1 / 1.1))) for _ in range(40)]
    costs = [MODEL.marginal(n, 0) for n in lengths]
    speed = {"fast": 1.0, "slow": 2.0}  # the slow one shares its core with a neighbour
    late = run(simulate(True, speed, lengths))
    at_arrival = run(simulate(False, speed, lengths))
    # balance of the real busy seconds: the slow worker's prompts count twice their prediction
    late_balance = balance(late, costs).balance
    arrival_balance = balance(at_arrival, costs).balance
    assert late_balance >= 0.9, (late, late_balance)
    assert arrival_balance < 0.8, (at_arrival, arrival_balance)
