"""Pure routing pieces: policies, the plan, the load book, balance, request estimates, SSE relay."""

from __future__ import annotations

import json

import pytest

from deepinfer.core.load import CostModel, EngineLoad, PrefillWork, WorkerLoad
from deepinfer.core.roles import Role, resolve_role
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.router.balance import balance, lpt_makespan
from deepinfer.router.loadbook import LoadBook
from deepinfer.router.policies import (
    DecodeLoad,
    Direct,
    EstimatedCompute,
    LeastRequests,
    NoWorker,
    RequestInfo,
    RoundRobin,
    TwoHop,
    WorkerView,
    handoff_pairs,
    plan,
    prefill_policy,
)
from deepinfer.router.stream import EventSplitter, carries_output, error_events
from deepinfer.web.errors import ApiError

MODEL = StepCostModel(1e-3, 1e-5, 1e-4, 1e-8, 1e-6, "test")


def view(url: str, role: Role = Role.BOTH, model: StepCostModel = MODEL, **load) -> WorkerView:
    return WorkerView(url, role, model, **load)


def test_estimated_compute_adds_the_request_cost_on_each_workers_own_model() -> None:
    req = RequestInfo(prompt_tokens=1000)
    slow = StepCostModel(1e-3, 1e-5, 1e-3, 1e-7, 1e-6, "test")  # 10x per token
    a, b = view("a", prefill_backlog_s=0.05), view("b", model=slow)
    # b is idle but predicts 1 s for this prompt; a finishes its 0.05 s backlog plus 0.11 s first
    assert EstimatedCompute().choose(req, [b, a]).url == "a"
    assert EstimatedCompute().choose(req, [view("a", prefill_backlog_s=2.0), b]).url == "b"


def test_estimated_compute_ties_break_on_active_requests_then_order() -> None:
    req = RequestInfo(10)
    assert (
        EstimatedCompute().choose(req, [view("a", active_requests=3), view("b", active_requests=1)]).url
        == "b"
    )
    assert EstimatedCompute().choose(req, [view("a"), view("b")]).url == "a"


def test_decode_load_weighs_kv_tokens_and_requests_and_avoids_full_workers() -> None:
    policy = DecodeLoad(request_weight_tokens=100)
    req = RequestInfo(50, max_tokens=50)
    many_short = view("a", active_requests=10, kv_tokens_held=500)  # 500 + 1000
    few_long = view("b", active_requests=1, kv_tokens_held=1200)  # 1200 + 100
    assert policy.choose(req, [many_short, few_long]).url == "b"
    full = view("b", active_requests=0, kv_tokens_held=960, kv_capacity_tokens=1000)
    assert policy.choose(req, [full, view("a", active_requests=5, kv_tokens_held=500)]).url == "a"
    assert policy.choose(req, [full]).url == "b"  # nothing has room: still served
    with pytest.raises(ValueError, match="kv_limit"):
        DecodeLoad(kv_limit=0)


def test_baselines() -> None:
    rr = RoundRobin()
    workers = [view("b"), view("a"), view("c")]
    assert [rr.choose(RequestInfo(1), workers).url for _ in range(4)] == ["a", "b", "c", "a"]
    assert [rr.choose(RequestInfo(1), [view("a"), view("c")]).url for _ in range(2)] == ["c", "a"]  # b gone
    assert (
        LeastRequests()
        .choose(RequestInfo(1), [view("a", active_requests=2), view("b", active_requests=1)])
        .url
        == "b"
    )
    assert prefill_policy("round-robin").name == "round-robin"
    with pytest.raises(ValueError, match="accepted: estimated-compute"):
        prefill_policy("random")


def test_plan_paths() -> None:
    pre, dec, both = (
        view("p", Role.PREFILL),
        view("d", Role.DECODE),
        view("x", Role.BOTH, prefill_backlog_s=9.0),
    )
    policies = (EstimatedCompute(), DecodeLoad())
    short, long = RequestInfo(100), RequestInfo(4000)
    assert plan(short, [pre, dec, both], *policies, 512, False) == Direct(dec, "short")
    # long without the handoff: the both-role worker, however loaded; decode-role only if there is none
    assert plan(long, [pre, dec, both], *policies, 512, False) == Direct(both, "long")
    assert plan(long, [pre, dec], *policies, 512, False) == Direct(dec, "long")
    # two hops once a prefill worker and a decode-capable one share a store; never across stores
    pre_s, dec_s = view("p", Role.PREFILL, kv_store_id="s1"), view("d", Role.DECODE, kv_store_id="s1")
    assert plan(long, [pre, dec, both], *policies, 512, True) == Direct(both, "long")  # no store
    assert plan(long, [pre_s, dec_s, both], *policies, 512, True) == TwoHop(pre_s, dec_s)
    assert plan(long, [pre_s, dec_s, both], *policies, 512, False) == Direct(both, "long")
    other = view("d", Role.DECODE, kv_store_id="s2")
    assert plan(long, [pre_s, other], *policies, 512, True) == Direct(other, "long")
    assert handoff_pairs([pre_s, dec_s]) == {"s1"} and not handoff_pairs([pre_s, other])
    down = view("d", Role.DECODE, kv_store_id="s1", admitted=False)
    assert plan(long, [pre_s, down, both], *policies, 512, True) == Direct(both, "long")
    assert plan(short, [pre_s, dec_s], *policies, 512, True) == Direct(dec_s, "short")
    with pytest.raises(NoWorker, match="admitted roles: prefill"):
        plan(short, [pre, view("d", Role.DECODE, admitted=False)], *policies, 512, False)
    with pytest.raises(NoWorker, match="none"):
        plan(short, [], *policies, 512, False)


def report(backlog_tokens: int = 0, active: int = 0, kv: int = 0, healthy: bool = True) -> WorkerLoad:
    return WorkerLoad(
        model="m", model_fingerprint="f", kv_layout="k", role=Role.BOTH, healthy=healthy, num_in_flight=active,
        engine=EngineLoad(num_running=active, prefill=PrefillWork.of([(backlog_tokens, 0)]), kv_tokens_held=kv,
                          kv_capacity_tokens=10_000),
        cost_model=CostModel.of(MODEL),
    )  # fmt: skip


def test_load_book_merges_reports_with_the_routers_own_dispatches() -> None:
    book = LoadBook()
    book.observe("a", report(), requested_at=0.0)
    cost = MODEL.marginal(1000, 0)
    book.dispatched("a", "r1", prefill_s=cost, kv_tokens=100, now=1.0)  # after the report: unknown to it
    v = book.view("a")
    assert (v.prefill_backlog_s, v.active_requests, v.kv_tokens_held) == (cost, 1, 100)
    book.observe("a", report(backlog_tokens=3000, active=1, kv=0), requested_at=2.0)  # now it knows r1
    reported = MODEL.marginal(3000, 0)
    assert book.view("a").prefill_backlog_s == pytest.approx(reported)
    book.prefilled("a", "r1", now=2.5)  # prompt done after the report: take its predicted cost off
    assert book.view("a").prefill_backlog_s == pytest.approx(reported - cost)
    book.finished("a", "r1", now=3.0)
    v = book.view("a")
    assert (v.active_requests, v.kv_tokens_held) == (0, 0)
    book.finished("a", "r1", now=3.5)  # idempotent
    book.observe("a", report(), requested_at=4.0)
    assert book.view("a").active_requests == 0 and not book._dispatches["a"]
    book.observe("a", report(healthy=False), requested_at=5.0)
    assert not book.view("a").admitted


def test_prefill_work_is_the_sum_of_marginal_costs() -> None:
    work = [(100, 0), (1, 500), (300, 64), (0, 10)]
    expected = sum(MODEL.marginal(n, c) for n, c in work if n)
    assert PrefillWork.of(work).seconds(MODEL) == pytest.approx(expected)


def test_resolve_role() -> None:
    assert resolve_role(None, "prefill") is Role.PREFILL
    assert resolve_role("decode", "prefill") is Role.DECODE
    with pytest.raises(ValueError, match="--role: 'mixed'"):
        resolve_role("mixed", "both")


def test_lpt_and_balance() -> None:
    assert lpt_makespan([3, 3, 2, 2, 2], 2) == 7  # LPT's textbook 7 (the optimum is 6)
    assert lpt_makespan([5, 1, 1, 1], 3) == 5
    b = balance({"a": 6.0, "b": 6.0}, [1, 1, 1, 1])
    assert b.balance == pytest.approx(1.0)
    skewed = balance({"a": 9.0, "b": 3.0}, [3, 3, 3, 3])  # the same 4 equal jobs, 3 on one worker
    assert skewed.perfect_makespan_s == pytest.approx(6.0) and skewed.balance == pytest.approx(6 / 9)
    with pytest.raises(ValueError):
        balance({}, [1.0])


def test_estimate_request() -> None:
    from deepinfer.model_zoo import default_model_path
    from deepinfer.router.estimate import estimate_request
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    text = "def fibonacci(n):\n    return n"
    n = len(tok.encode(text, add_special_tokens=False))
    assert estimate_request("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 7}, tok) == RequestInfo(
        3, 7
    )
    chat = estimate_request("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, tok)
    assert n < chat.prompt_tokens <= n + 3 and chat.max_tokens is None
    msgs = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}], "max_tokens": 5}
    assert estimate_request("/v1/messages", msgs, tok).max_tokens == 5
    with pytest.raises(ValueError, match="does not route"):
        estimate_request("/v1/embeddings", {}, tok)


def sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def test_event_splitter_returns_whole_events_only() -> None:
    s = EventSplitter()
    stream = sse({"a": 1}) + b"event: x\r\ndata: {}\r\n\r\n" + sse("[DONE]")
    got = [e for i in range(0, len(stream), 7) for e in s.feed(stream[i : i + 7])]
    assert got == [sse({"a": 1}), b"event: x\ndata: {}\n\n", sse("[DONE]")]


def test_carries_output() -> None:
    role_only = sse({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    assert not carries_output("chat", role_only)
    assert carries_output("chat", sse({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]}))
    assert carries_output("completions", sse({"choices": [{"text": "", "finish_reason": "length"}]}))
    assert not carries_output("messages", b"event: message_start\n" + sse({"type": "message_start"}))
    assert carries_output("messages", sse({"type": "content_block_delta"}))
    assert not carries_output("responses", sse({"type": "response.created"}))
    assert carries_output("responses", sse({"type": "response.output_text.delta"}))
    assert carries_output("chat", sse({"error": {"message": "x"}})) and carries_output("chat", sse("[DONE]"))


def test_error_events_in_each_apis_shape() -> None:
    err = ApiError(502, "gone")
    chat = error_events("chat", err, 3).decode().split("\n\n")
    assert (
        json.loads(chat[0].removeprefix("data: "))["error"]["message"] == "gone" and chat[1] == "data: [DONE]"
    )
    msg = error_events("messages", err, 3).decode()
    assert (
        msg.startswith("event: error\n")
        and json.loads(msg.split("data: ")[1])["error"]["type"] == "api_error"
    )
    resp = json.loads(error_events("responses", err, 3).decode().split("data: ")[1])
    assert resp["type"] == "error" and resp["sequence_number"] == 3


def test_load_book_counts_what_the_server_admitted_but_the_engine_has_not_seen() -> None:
    import msgspec

    book = LoadBook()
    book.observe("a", report(), requested_at=0.0)
    book.dispatched("a", "x", prefill_s=0.3, kv_tokens=10, now=1.0)
    book.dispatched("a", "y", prefill_s=0.2, kv_tokens=20, now=1.5)
    # x is in the engine (its 1000 tokens in the backlog); y was admitted during the engine's step
    lagging = msgspec.structs.replace(report(backlog_tokens=1000, active=1), num_in_flight=2)
    book.observe("a", lagging, requested_at=2.0)
    v = book.view("a")
    assert v.prefill_backlog_s == pytest.approx(MODEL.marginal(1000, 0) + 0.2)
    assert (v.active_requests, v.kv_tokens_held) == (2, 20)
    book.finished("a", "y", now=2.5)
    v = book.view("a")
    assert v.prefill_backlog_s == pytest.approx(MODEL.marginal(1000, 0)) and v.active_requests == 1
