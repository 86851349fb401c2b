"""The OpenAI-compatible APIs, driven by the official ``openai`` client against the real server:
Chat Completions, Completions and Responses, plain and streamed, with scripted model outputs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from deepinfer.recipe import ChatRecipe
from deepinfer.recipe import tokens as T
from tests.server.conftest import MODEL_NAME, ServerHandle

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_SCRIPT = (
    f"The user wants the weather.{T.THINK_END}Let me look.{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}get_weather"
    f'{T.TOOL_SEP}{{"city": "Paris"}}{T.TOOL_CALL_END}{T.TOOL_CALLS_END}'
)


@pytest.fixture(scope="module")
def recipe(server: ServerHandle) -> ChatRecipe:
    return server.app.state.serving.recipe


def test_chat_plain_and_streamed_agree_and_count_tokens(
    server: ServerHandle, openai_client: openai.OpenAI, recipe: ChatRecipe
) -> None:
    script = server.runner.script("[plain-chat]", "Paris is sunny today.")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "[plain-chat] Weather?"},
    ]
    reply = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=64
    )
    choice = reply.choices[0]
    assert choice.message.content == "Paris is sunny today." and choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(recipe.encode_chat(messages))
    assert reply.usage.completion_tokens == len(script) + 1  # the scripted tokens and EOS

    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Paris is sunny today."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_chat_tool_call_and_reasoning(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    server.runner.script("[tool-chat]", TOOL_SCRIPT)
    request = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "[tool-chat] Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        reasoning_effort="high",
        max_tokens=100,
    )
    reply = openai_client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == "The user wants the weather."
    assert message.content == "Let me look."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0

    reasoning, content, calls = "", "", {}
    for chunk in openai_client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
    assert (reasoning, content) == ("The user wants the weather.", "Let me look.")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_chat_history_with_tool_results_is_encoded_as_deepseek(
    server: ServerHandle, openai_client: openai.OpenAI, recipe: ChatRecipe
) -> None:
    server.runner.script("[tool-result]", "It is sunny in Paris.")
    messages = [
        {"role": "user", "content": "[tool-result] Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == "It is sunny in Paris."
    expected = recipe.encode_chat(
        [
            {"role": "user", "content": "[tool-result] Weather in Paris?"},
            {"role": "assistant", "tool_calls": [{"name": "get_weather", "arguments": '{"city":"Paris"}'}]},
            {"role": "tool", "content": "sunny, 21 C"},
        ],
        tools=[{**WEATHER_TOOL["function"]}],
    )
    assert reply.usage.prompt_tokens == len(expected)


def test_repeated_prefix_reports_cached_tokens(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    server.runner.script("[cache]", "ok")
    system = "You are a meticulous assistant. " * 12  # several KV blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "[cache] hello"}]
    first = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages)
    second = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages)
    block = server.engine.cache_spec.block_size
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % block == 0 and cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_stop_strings_never_leak_into_the_stream(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    server.runner.script("[stop]", "Hello STOP and more")
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "[stop] go"}], stop=["STOP"])
    reply = openai_client.chat.completions.create(**request)
    assert reply.choices[0].message.content == "Hello " and reply.choices[0].finish_reason == "stop"
    deltas = [
        c.choices[0].delta.content or ""
        for c in openai_client.chat.completions.create(**request, stream=True)
    ]
    assert "".join(deltas) == "Hello " and not any("S" in d for d in deltas)


def test_chat_logprobs_and_n(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "random words"}],
        max_tokens=5,
        n=2,
        logprobs=True,
        top_logprobs=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in reply.choices] == [0, 1] and reply.usage.completion_tokens == 10
    for choice in reply.choices:
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in choice.logprobs.content)


def test_completions_plain_streamed_and_batched(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    server.runner.script("[complete]", " return a + b")
    reply = openai_client.completions.create(
        model=MODEL_NAME, prompt="[complete] def add(a, b):", max_tokens=20
    )
    assert reply.choices[0].text == " return a + b" and reply.choices[0].finish_reason == "stop"
    tokenizer = server.engine.tokenizer
    assert reply.usage.prompt_tokens == len(tokenizer.encode("[complete] def add(a, b):"))

    streamed = openai_client.completions.create(
        model=MODEL_NAME, prompt="[complete] def add(a, b):", max_tokens=20, stream=True, echo=True
    )
    assert "".join(c.choices[0].text for c in streamed) == "[complete] def add(a, b): return a + b"

    batch = openai_client.completions.create(
        model=MODEL_NAME, prompt=["[complete] x", "y"], max_tokens=3, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 2 * 3 + 2 * 3
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] == tokenizer.decode(tokenizer.encode(" return a + b", False)[:3])

    ids = tokenizer.encode("[complete] def add(a, b):")
    by_ids = openai_client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=20)
    assert by_ids.choices[0].text == " return a + b" and by_ids.usage.prompt_tokens == len(ids)


def test_responses_plain_and_streamed(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    server.runner.script("[responses]", TOOL_SCRIPT.replace("get_weather", "get_weather"))
    request = dict(
        model=MODEL_NAME,
        instructions="Be brief.",
        input="[responses] Weather in Paris?",
        tools=[{"type": "function", **WEATHER_TOOL["function"]}],
        reasoning={"effort": "medium"},
        max_output_tokens=100,
    )
    response = openai_client.responses.create(**request)
    assert response.status == "completed"
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == "The user wants the weather."
    assert response.output_text == "Let me look."
    assert (
        json.loads(response.output[2].arguments) == {"city": "Paris"}
        and response.output[2].name == "get_weather"
    )
    assert response.usage.output_tokens_details.reasoning_tokens > 0

    events = list(openai_client.responses.create(**request, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (text, json.loads(arguments)) == ("Let me look.", {"city": "Paris"})
    assert events[-1].response.usage.output_tokens == response.usage.output_tokens


def test_responses_truncated_by_max_output_tokens(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    server.runner.script("[truncated]", "one two three four five six seven eight")
    response = openai_client.responses.create(
        model=MODEL_NAME, input="[truncated] count", max_output_tokens=3
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_models_health_and_metrics(server: ServerHandle, openai_client: openai.OpenAI) -> None:
    (model,) = openai_client.models.list().data
    assert model.id == MODEL_NAME
    health = httpx.get(f"{server.url}/health").json()
    assert (health["status"], health["role"]) == ("ok", "both")
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "deepinfer_num_requests_running",
        "deepinfer_num_requests_waiting",
        "deepinfer_kv_cache_usage_ratio",
        "deepinfer_prefix_cache_hit_rate",
        "deepinfer_time_to_first_token_seconds_bucket",
        "deepinfer_inter_token_latency_seconds_bucket",
        "deepinfer_e2e_request_latency_seconds_bucket",
        "deepinfer_prompt_tokens_total",
        "deepinfer_cached_prompt_tokens_total",
        "deepinfer_generation_tokens_total",
    ):
        assert name in metrics, name
    values = {
        line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line and line[0] != "#"
    }
    assert values["deepinfer_time_to_first_token_seconds_count"] > 0
    assert values["deepinfer_generation_tokens_total"] > 0


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_structured_outputs_from_response_format(openai_client: openai.OpenAI) -> None:
    """The random model, constrained by the schema, can only answer with a matching object."""
    messages = [{"role": "user", "content": "Which city?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    reply = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, response_format=fmt, max_tokens=40, temperature=0
    )
    assert json.loads(reply.choices[0].message.content)["city"] in ("Paris", "Lyon")
    text_format = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}}
    response = openai_client.responses.create(
        model=MODEL_NAME, input="Which city?", text=text_format, max_output_tokens=40, temperature=0
    )
    assert json.loads(response.output_text)["city"] in ("Paris", "Lyon")


def test_refused_constraints_are_400_even_when_streaming(openai_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Which city?"}]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}
    with pytest.raises(openai.BadRequestError, match="strang"):
        openai_client.chat.completions.create(
            model=MODEL_NAME, messages=messages, response_format=bad, stream=True
        )
    with pytest.raises(openai.BadRequestError, match="non-thinking") as info:
        openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            response_format={"type": "json_object"},
            reasoning_effort="high",
        )
    assert info.value.body["param"] == "response_format"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lyon", "Nice"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_return_valid_arguments(openai_client: openai.OpenAI, choice) -> None:
    """tool_choice "required" or a named tool constrains the random model to a well-formed call."""
    for seed in range(3):
        reply = openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Weather in Paris for three days?"}],
            tools=[WEATHER_TOOL, CLOCK_TOOL],
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        args = json.loads(calls[0].function.arguments)
        if calls[0].function.name == "get_weather":
            assert args["city"] in ("Paris", "Lyon", "Nice") and 1 <= args["days"] <= 7
        else:
            assert choice == "required" and args == {}
