"""The Anthropic-compatible Messages API, driven by the official ``anthropic`` client against the
real server: plain and streamed, thinking, tool use and tool results, stop sequences, cache usage."""

from __future__ import annotations

import anthropic

from deepinfer.recipe import tokens as T
from tests.server.conftest import MODEL_NAME, ServerHandle

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SCRIPT = (
    f"The user wants the weather.{T.THINK_END}Let me look.{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}get_weather"
    f'{T.TOOL_SEP}{{"city": "Paris"}}{T.TOOL_CALL_END}{T.TOOL_CALLS_END}'
)


def test_messages_plain_and_streamed(server: ServerHandle, anthropic_client: anthropic.Anthropic) -> None:
    server.runner.script("[messages]", SCRIPT)
    request = dict(
        model=MODEL_NAME,
        max_tokens=100,
        system="Be brief.",
        messages=[{"role": "user", "content": "[messages] Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        thinking={"type": "enabled", "budget_tokens": 64},
    )
    message = anthropic_client.messages.create(**request)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.thinking == "The user wants the weather." and text.text == "Let me look."
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Paris"}) and tool_use.id.startswith(
        "toolu_"
    )
    assert message.stop_reason == "tool_use"

    with anthropic_client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.content[1].text == "Let me look."
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == message.usage.output_tokens


def test_tool_results_cache_and_stop_sequences(
    server: ServerHandle, anthropic_client: anthropic.Anthropic
) -> None:
    server.runner.script("[tool-result]", "Sunny in Paris. END of report")
    system = "You are a meticulous weather assistant. " * 10  # several KV blocks
    messages = [
        {"role": "user", "content": "[tool-result] Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}],
        },
    ]
    request = dict(model=MODEL_NAME, max_tokens=50, system=system, messages=messages, tools=[WEATHER_TOOL])
    first = anthropic_client.messages.create(**request, stop_sequences=["END"])
    assert first.content[0].text == "Sunny in Paris. "
    assert (first.stop_reason, first.stop_sequence) == ("stop_sequence", "END")

    recipe = server.app.state.serving.recipe
    expected = recipe.encode_chat(
        [
            {"role": "system", "content": system},
            {"role": "user", "content": "[tool-result] Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
            },
            {"role": "tool", "content": "sunny, 21 C"},
        ],
        tools=[
            {
                "name": "get_weather",
                "description": "Get the weather",
                "parameters": WEATHER_TOOL["input_schema"],
            }
        ],
    )
    usage = first.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(expected)

    second = anthropic_client.messages.create(**request)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == len(expected)
    assert second.content[0].text == "Sunny in Paris. END of report" and second.stop_reason == "end_turn"


def test_max_tokens_stop_reason(server: ServerHandle, anthropic_client: anthropic.Anthropic) -> None:
    server.runner.script("[long]", "one two three four five six seven")
    message = anthropic_client.messages.create(
        model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "[long] count"}]
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2
