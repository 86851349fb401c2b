"""Regression tests for the server defects of issue 14 (each failed on main before the fix): lone
surrogates, server defaults and ceilings for max_tokens, over-long text refused before tokenizing,
API docs behind the key, the missing routes, empty completions prompts, schema errors that name
their field, idle and slow connections, request deadlines, and a request whose add fails in an
unexpected way (it fails alone; the engine and the other requests carry on)."""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ScriptedRunner, ServerHandle, start_server

USER = [{"role": "user", "content": "hi"}]
KEY = "sk-defects"
AUTH = {"Authorization": f"Bearer {KEY}"}


def post_raw(url: str, text: str, headers: dict | None = None) -> httpx.Response:
    """POST a JSON body written by hand (so it can hold a lone surrogate escape)."""
    return httpx.post(
        url, content=text.encode(), headers={"content-type": "application/json", **(headers or {})}
    )


SURROGATE_CASES = [
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": ["ok", "a\\udfff b"]}', "prompt[1]"),
    ("/v1/responses", '{"model": "%s", "max_output_tokens": 2, "input": "x\\ud83d", "instructions": "be"}', "input"),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "system": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}',
     "system"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "template", "param"), SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(
    server: ServerHandle, path: str, template: str, param: str
) -> None:
    response = post_raw(server.url + path, template % MODEL_NAME)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in error["message"] and "surrogate" in error["message"]
    if path != "/v1/messages":
        assert error["param"] == param
    paired = post_raw(server.url + path, (template % MODEL_NAME).replace("\\ud800", "\\ud83d\\ude00"))
    assert paired.status_code != 500


def test_an_empty_completions_prompt_list_is_a_400(server: ServerHandle) -> None:
    for prompt in ([], [[]]):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"


def test_get_model_by_id(server: ServerHandle) -> None:
    card = httpx.get(f"{server.url}/v1/models/{MODEL_NAME}")
    assert (
        card.status_code == 200 and card.json()["id"] == MODEL_NAME and card.json()["max_model_len"] == 1024
    )
    missing = httpx.get(f"{server.url}/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_anthropic_count_tokens_counts_what_messages_would_use(server: ServerHandle) -> None:
    conversation = {
        "model": MODEL_NAME,
        "system": "be brief",
        "messages": [{"role": "user", "content": "count me"}],
    }
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json=conversation)
    assert counted.status_code == 200, counted.text
    usage = httpx.post(f"{server.url}/v1/messages", json={**conversation, "max_tokens": 1}).json()["usage"]
    assert counted.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    wrong = httpx.post(f"{server.url}/v1/messages/count_tokens", json={**conversation, "model": "claude"})
    assert wrong.status_code == 404 and wrong.json()["type"] == "error"


BROKEN = {"type": "object", "properties": {"a": {"type": "strin"}}}
GOOD = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL_CASES = [
    ("/v1/chat/completions",
     {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "ok", "parameters": GOOD}},
                {"type": "function", "function": {"name": "bad", "parameters": BROKEN}}]},
     "tools[1].function.parameters"),
    ("/v1/responses",
     {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, "tool_choice": "required",
      "tools": [{"type": "function", "name": "bad", "parameters": BROKEN}]},
     "tools[0].parameters"),
    ("/v1/messages",
     {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "tool_choice": {"type": "any"},
      "tools": [{"name": "bad", "input_schema": BROKEN}]},
     "tools[0].input_schema"),
    ("/v1/chat/completions",
     {"model": MODEL_NAME, "messages": USER, "max_tokens": 2,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema"),
    ("/v1/responses",
     {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2,
      "text": {"format": {"type": "json_schema", "name": "x", "schema": BROKEN}}},
     "text.format.schema"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), TOOL_CASES, ids=[c[2] for c in TOOL_CASES])
def test_a_schema_that_cannot_be_enforced_names_its_field(
    server: ServerHandle, path: str, body: dict, param: str
) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(param) and "%json" not in error["message"]  # no grammar internals
    if path != "/v1/messages":
        assert error["param"] == param


def test_text_longer_than_the_context_can_hold_is_refused_before_tokenizing(server: ServerHandle) -> None:
    huge = "x" * 900_000
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": huge}]}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": huge}),
        (
            "/v1/messages",
            {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": huge}]},
        ),
    ):
        start = time.monotonic()
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert "characters" in response.text and time.monotonic() - start < 2


class AddFailure(ScriptedRunner):
    """Also makes the engine's ``add_request`` fail with a non-ValueError for prompts containing
    token id 13 followed by 37 (as a bug on one request's path would)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        add = engine.add_request

        def failing_add(request_id, prompt, prompt_token_ids, params):
            ids = list(prompt_token_ids or [])
            if any(a == 13 and b == 37 for a, b in itertools.pairwise(ids)):
                raise KeyError("simulated bug while adding a request")
            return add(request_id, prompt, prompt_token_ids, params)

        engine.add_request = failing_add


@pytest.fixture(scope="module")
def limited(deepseek_model: Path) -> Iterator[ServerHandle]:
    yield from start_server(
        deepseek_model,
        runner=AddFailure,
        api_key=KEY,
        max_tokens_default=3,
        max_tokens_limit=40,
        timeout_keep_alive_s=1.0,
        body_timeout_s=1.0,
    )


def test_max_tokens_has_a_server_default_and_a_ceiling(limited: ServerHandle) -> None:
    chat = {"model": MODEL_NAME, "messages": USER, "ignore_eos": True}
    reply = httpx.post(f"{limited.url}/v1/chat/completions", json=chat, headers=AUTH)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    over = httpx.post(f"{limited.url}/v1/chat/completions", json={**chat, "max_tokens": 41}, headers=AUTH)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert "limit of 40" in over.json()["error"]["message"]


def test_the_api_documentation_needs_the_key(limited: ServerHandle) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(limited.url + path).status_code == 401
        assert httpx.get(limited.url + path, headers=AUTH).status_code == 200
    assert httpx.get(f"{limited.url}/health").status_code == 200


def test_an_unexpected_error_adding_one_request_fails_only_that_request(limited: ServerHandle) -> None:
    good = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    bad = httpx.post(f"{limited.url}/v1/completions", json={**good, "prompt": [1, 13, 37]}, headers=AUTH)
    assert (bad.status_code == 500 and "simulated bug" not in bad.text) or "KeyError" in bad.text
    assert httpx.get(f"{limited.url}/health").status_code == 200
    for _ in range(2):
        assert httpx.post(f"{limited.url}/v1/completions", json=good, headers=AUTH).status_code == 200
    limited.wait_idle()


def test_idle_connections_and_slow_bodies_time_out(limited: ServerHandle) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as idle:
        start = time.monotonic()
        assert idle.recv(1024) == b""  # closed by the server, having sent nothing
        assert time.monotonic() - start < 3
    with socket.create_connection((host, int(port)), timeout=5) as slow:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        slow.sendall((head + "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
        start = time.monotonic()
        reply = slow.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408") and time.monotonic() - start < 3


class SlowSteps(ScriptedRunner):
    def execute(self, scheduled):
        time.sleep(0.05)
        return super().execute(scheduled)


@pytest.fixture(scope="module")
def deadline_server(deepseek_model: Path) -> Iterator[ServerHandle]:
    yield from start_server(deepseek_model, runner=SlowSteps, request_timeout_s=0.5)


def test_a_request_past_its_deadline_fails_and_frees_its_blocks(deadline_server: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 200, "ignore_eos": True}
    start = time.monotonic()
    plain = httpx.post(f"{deadline_server.url}/v1/chat/completions", json=body, timeout=30)
    assert plain.status_code == 504 and "request timeout" in plain.json()["error"]["message"]
    assert time.monotonic() - start < 3
    with httpx.stream(
        "POST", f"{deadline_server.url}/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert "request timeout" in lines[-2] and lines[-1] == "data: [DONE]"
    deadline_server.wait_idle(timeout=10)  # the core aborted them: every KV block is back
    quick = httpx.post(f"{deadline_server.url}/v1/chat/completions", json={**body, "max_tokens": 2})
    assert quick.status_code == 200 and json.loads(quick.text)["usage"]["completion_tokens"] == 2
