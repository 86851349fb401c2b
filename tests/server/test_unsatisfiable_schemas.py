"""A JSON schema that no finite value satisfies (issue 34, defect 9) is a 400 naming the schema's
field, on every API and every way a schema constrains the output: a response format, and a tool's
parameters under a forced tool call; through the real test server and the official clients. Before,
the recursive schema below compiled, and the answer was ``{`` with ``finish_reason: stop``."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ServerHandle

RECURSIVE = {
    "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
    "$ref": "#/$defs/n",
}
REASON = "no finite JSON value satisfies it: #/$defs/n can never be completed"
MESSAGES = [{"role": "user", "content": "Give me a list."}]
CHAT_TOOL = {"type": "function", "function": {"name": "walk", "parameters": RECURSIVE}}
RESPONSES_TOOL = {"type": "function", "name": "walk", "parameters": RECURSIVE}


def _refused(info: pytest.ExceptionInfo, param: str) -> None:
    """The 400 names the schema's field first (and, in OpenAI's shape, as ``param``) and says why."""
    body = info.value.body
    error = body.get("error", body)  # Anthropic's envelope, or OpenAI's error object
    assert error["message"].startswith(f"{param}: ") and REASON in error["message"], error
    assert error.get("param", param) == param


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format(openai_client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "list", "schema": RECURSIVE}}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, response_format=fmt, max_tokens=8, stream=stream
        )
    _refused(info, "response_format.json_schema.schema")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "walk"}}])
def test_chat_forced_tool_call(openai_client: openai.OpenAI, choice) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[CHAT_TOOL], tool_choice=choice, max_tokens=8
        )
    _refused(info, "tools[0].function.parameters")


def test_chat_tool_choice_auto_does_not_enforce_the_schema(openai_client: openai.OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[CHAT_TOOL], tool_choice="auto", max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_responses_text_format_and_forced_tool(openai_client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "list", "schema": RECURSIVE}}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(
            model=MODEL_NAME, input="Give me a list.", text=text, max_output_tokens=8
        )
    _refused(info, "text.format.schema")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(
            model=MODEL_NAME,
            input="Give me a list.",
            tools=[RESPONSES_TOOL],
            tool_choice="required",
            max_output_tokens=8,
        )
    _refused(info, "tools[0].parameters")


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "walk"}])
def test_messages_forced_tool(anthropic_client: anthropic.Anthropic, choice) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(
            model=MODEL_NAME,
            max_tokens=8,
            messages=MESSAGES,
            tools=[{"name": "walk", "input_schema": RECURSIVE}],
            tool_choice=choice,
        )
    _refused(info, "tools[0].input_schema")


def test_the_server_still_serves(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    reply = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].message is not None
    server.wait_idle()
