"""Details strict clients check (issue 35): strict JSON schemas end to end, the exact shapes of
chat messages, Responses items, Anthropic's model list and ``/metrics``, and refusals of what the
server does not support."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from deepinfer.recipe import tokens as T
from tests.server.conftest import MODEL_NAME, ServerHandle

OPEN_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}}


def test_strict_json_schema_closes_objects_end_to_end(openai_client: openai.OpenAI) -> None:
    """The random model at temperature 1 under a strict schema that does not say
    ``additionalProperties``: every answer completes and holds no key beyond ``city``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": OPEN_SCHEMA, "strict": True}}
    for seed in range(4):
        reply = openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Which city?"}],
            response_format=fmt,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
        )
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        assert set(json.loads(reply.choices[0].message.content)) <= {"city"}
        response = openai_client.responses.create(
            model=MODEL_NAME,
            input="Which city?",
            text={"format": {"type": "json_schema", "name": "c", "schema": OPEN_SCHEMA, "strict": True}},
            max_output_tokens=40,
            temperature=1.0,
        )
        assert response.status == "completed", response.output_text
        assert set(json.loads(response.output_text)) <= {"city"}


TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
}
ONLY_CALL = (
    f"{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}get_weather{T.TOOL_SEP}"
    f'{{"city": "Paris"}}{T.TOOL_CALL_END}{T.TOOL_CALLS_END}'
)


def test_chat_keys_openai_always_sends(server: ServerHandle) -> None:
    """A message that is only tool calls has ``content: null`` and ``refusal: null``; choices and
    chunk choices carry ``logprobs: null`` (and chunks ``finish_reason: null``) when unset."""
    server.runner.script("[shape-call]", ONLY_CALL)
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "[shape-call] weather?"}],
        "tools": [TOOL],
        "max_tokens": 60,
    }
    (choice,) = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["logprobs"] is None
    message = choice["message"]
    assert message["content"] is None and message["refusal"] is None and len(message["tool_calls"]) == 1
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(
        "logprobs" in c and "finish_reason" in c for chunk in chunks for c in chunk["choices"]
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_top_logprobs_needs_logprobs(server: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "logprobs": True, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_head_metrics(server: ServerHandle) -> None:
    response = httpx.head(f"{server.url}/metrics")
    assert response.status_code == 200 and response.content == b""
    assert response.headers["content-type"].startswith("text/plain")


def test_anthropic_model_list_shape(server: ServerHandle, anthropic_client: anthropic.Anthropic) -> None:
    """With ``anthropic-version`` (sent by Anthropic's client), the model routes answer in Anthropic's
    shapes; without it, in OpenAI's."""
    page = anthropic_client.models.list()
    (model,) = page.data
    assert (model.type, model.id, model.display_name) == ("model", MODEL_NAME, MODEL_NAME)
    assert model.created_at.tzinfo is not None
    raw = httpx.get(f"{server.url}/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert (raw["has_more"], raw["first_id"], raw["last_id"]) == (False, MODEL_NAME, MODEL_NAME)
    assert anthropic_client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.models.retrieve("other")
    assert httpx.get(f"{server.url}/v1/models").json()["object"] == "list"


IMAGE_CASES = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "'image_url'",
    ),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "'input_image'",
    ),
    (
        "/v1/messages",
        {
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}],
        },
        "'image'",
    ),
]


@pytest.mark.parametrize(("path", "body", "kind"), IMAGE_CASES, ids=[c[0] for c in IMAGE_CASES])
def test_unsupported_content_parts_are_400_saying_so(server: ServerHandle, path, body, kind) -> None:
    response = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert kind in message and "not supported" in message and "text only" in message


def test_responses_item_cut_by_max_output_tokens_is_incomplete_when_streamed(
    server: ServerHandle, openai_client: openai.OpenAI
) -> None:
    """Reasoning that closed before the limit is ``completed``; the message the limit cut is
    ``incomplete``, in its ``response.output_item.done`` event and in the final response alike."""
    ids = server.runner.script("[shape-cut]", f"Short.{T.THINK_END}one two three four five six seven")
    limit = ids.index(server.engine.tokenizer.token_to_id(T.THINK_END)) + 3
    request = dict(
        model=MODEL_NAME,
        input="[shape-cut] count",
        reasoning={"effort": "high"},
        max_output_tokens=limit,
    )
    events = list(openai_client.responses.create(**request, stream=True))
    done = [(e.item.type, e.item.status) for e in events if e.type == "response.output_item.done"]
    assert done == [("reasoning", "completed"), ("message", "incomplete")]
    final = events[-1]
    assert final.type == "response.incomplete"
    assert [(i.type, i.status) for i in final.response.output] == done
    plain = openai_client.responses.create(**request)
    assert plain.status == "incomplete" and [(i.type, i.status) for i in plain.output] == done


TWO_CALLS = (
    f'{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}get_weather{T.TOOL_SEP}{{"city": "Paris"}}{T.TOOL_CALL_END}'
    f'{T.TOOL_CALL_BEGIN}get_weather{T.TOOL_SEP}{{"city": "Lyon"}}{T.TOOL_CALL_END}{T.TOOL_CALLS_END}'
)


def test_parallel_tool_calls_off_stops_generation_after_one_call(
    server: ServerHandle, openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic
) -> None:
    """A model that would call two tools: with parallel calls off, generation ends on the first
    call's closing token (so the usage counts only those tokens); with them on, both calls come."""
    ids = server.runner.script("[shape-two]", TWO_CALLS)
    one_call = ids.index(server.engine.tokenizer.token_to_id(T.TOOL_CALL_END)) + 1
    messages = [{"role": "user", "content": "[shape-two] weather?"}]
    chat = dict(model=MODEL_NAME, messages=messages, tools=[TOOL], max_tokens=80)
    both = openai_client.chat.completions.create(**chat)
    assert len(both.choices[0].message.tool_calls) == 2
    single = openai_client.chat.completions.create(**chat, parallel_tool_calls=False)
    (call,) = single.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert single.choices[0].finish_reason == "tool_calls" and single.usage.completion_tokens == one_call

    tool = {"type": "function", **TOOL["function"]}
    response = openai_client.responses.create(
        model=MODEL_NAME, input=messages, tools=[tool], parallel_tool_calls=False, max_output_tokens=80
    )
    assert [i.type for i in response.output] == ["function_call"]
    assert response.usage.output_tokens == one_call

    anthropic_tool = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
    reply = anthropic_client.messages.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[anthropic_tool],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        max_tokens=80,
    )
    assert [b.type for b in reply.content] == ["tool_use"] and reply.stop_reason == "tool_use"
    assert reply.usage.output_tokens == one_call
