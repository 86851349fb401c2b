"""Malformed requests get a 4xx in the called API's own error shape, naming the field at fault."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ServerHandle

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL_NAME, "messages": USER}

OPENAI_CASES = [
    ("/v1/chat/completions", {"model": MODEL_NAME}, "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": 7}, "temperature"),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "hi"}]},
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user"}]},
        "messages[0].user.content",
    ),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**70}, "seed"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "echo": True, "logprobs": 2}, "echo"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": {"text": "x"}}, "prompt"),
    (
        "/v1/responses",
        {"model": MODEL_NAME, "input": "hi", "previous_response_id": "resp_1"},
        "previous_response_id",
    ),
    ("/v1/responses", {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ("/v1/responses", {"model": MODEL_NAME, "input": [{"type": "function_call_output"}]}, "input"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), OPENAI_CASES, ids=[f"{c[0]}:{c[2]}" for c in OPENAI_CASES]
)
def test_openai_errors_name_the_field(server: ServerHandle, path: str, body: dict, param: str) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split("[")[0] in error["message"]


def test_max_tokens_beyond_the_context_says_the_limit(server: ServerHandle) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 5000})
    message = response.json()["error"]["message"]
    assert "context length 1024" in message and "at most" in message and "new tokens fit" in message


ANTHROPIC_BASE = {"model": MODEL_NAME, "max_tokens": 10, "messages": USER}
ANTHROPIC_CASES = [
    ({"model": MODEL_NAME, "messages": USER}, "max_tokens"),
    ({**ANTHROPIC_BASE, "messages": []}, "messages"),
    ({**ANTHROPIC_BASE, "temperature": 1.5}, "temperature"),
    ({**ANTHROPIC_BASE, "stop_sequences": [""]}, "stop_sequences"),
    ({**ANTHROPIC_BASE, "max_tokens": 5000}, "context length"),
    ({**ANTHROPIC_BASE, "tool_choice": {"type": "any"}}, "tool_choice"),
    (
        {**ANTHROPIC_BASE, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        "messages[0].content",
    ),
]


@pytest.mark.parametrize(("body", "mentions"), ANTHROPIC_CASES, ids=[c[1] for c in ANTHROPIC_CASES])
def test_anthropic_errors_in_anthropic_shape(server: ServerHandle, body: dict, mentions: str) -> None:
    response = httpx.post(f"{server.url}/v1/messages", json=body)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert mentions in payload["error"]["message"]


def test_invalid_json_and_unknown_routes(server: ServerHandle) -> None:
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/messages", content=b"[", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    missing = httpx.get(f"{server.url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()


def test_unknown_model_is_404_for_both_clients(
    openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic
) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="gpt-17", messages=USER)
    assert info.value.body["code"] == "model_not_found" and "gpt-17" in info.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        anthropic_client.messages.create(model="claude-17", max_tokens=5, messages=USER)
    assert info.value.body["error"]["type"] == "not_found_error"


def test_oversized_bodies_get_413(server: ServerHandle) -> None:
    limit = server.config.max_request_bytes
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * (limit + 1)}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=huge)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(limit // 65536 + 2):
            yield b"y" * 65536
        yield b'"}]}'

    response = httpx.post(
        f"{server.url}/v1/messages", content=chunked(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


def test_the_openapi_document_says_invalid_requests_get_400(server: ServerHandle) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    posts = {path: ops["post"] for path, ops in schema["paths"].items() if "post" in ops}
    assert set(posts) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
    assert all("400" in op["responses"] and "422" not in op["responses"] for op in posts.values())
