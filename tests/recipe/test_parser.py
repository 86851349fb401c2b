"""Reading completions back: reasoning, answer and tool calls from token ids, incrementally, with
stop strings held back and never a partial marker or half a character in the text."""

from __future__ import annotations

import json

import pytest

from deepinfer.recipe import BlockDelta, BlockEnd, BlockStart, ChatEvent, ChatRecipe, StopStringBuffer
from deepinfer.recipe import tokens as T

TOOL_CALL = (
    f"{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}get_weather{T.TOOL_SEP}"
    '{"city": "Paris"}'
    f"{T.TOOL_CALL_END}{T.TOOL_CALL_BEGIN}get_time{T.TOOL_SEP}"
    '{"zone": "CET"}'
    f"{T.TOOL_CALL_END}{T.TOOL_CALLS_END}"
)


def model_output(recipe: ChatRecipe, text: str) -> list[int]:
    """Token ids as the model emits them: marker texts are the control tokens."""
    return recipe.tokenizer.encode(text, add_special_tokens=False)


def stream(
    recipe: ChatRecipe, ids: list[int], prompt: list[int] = (), stop: tuple[str, ...] = (), stop_reason=None
):
    """Feed one token at a time; returns (all events, the parser)."""
    parser = recipe.parser(prompt, stop)
    events: list[ChatEvent] = []
    for token in ids:
        events += parser.feed([token])
    events += parser.finish(stop_reason)
    return events, parser


def deltas_by_block(events: list[ChatEvent]) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        if isinstance(e, BlockDelta):
            out[e.index] = out.get(e.index, "") + e.text
    return out


def test_reasoning_answer_and_tool_calls(recipe: ChatRecipe) -> None:
    prompt = recipe.encode_chat([{"role": "user", "content": "Hi"}], thinking=True)
    ids = model_output(recipe, f"Let me think.{T.THINK_END}Checking both.{TOOL_CALL}{T.EOS}")
    events, parser = stream(recipe, ids, prompt)
    message = parser.result
    assert message.reasoning == "Let me think."
    assert message.content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    starts = [(e.index, e.kind, e.name) for e in events if isinstance(e, BlockStart)]
    assert starts == [
        (0, "reasoning", None),
        (1, "text", None),
        (2, "tool_call", "get_weather"),
        (3, "tool_call", "get_time"),
    ]
    assert [e.index for e in events if isinstance(e, BlockEnd)] == [0, 1, 2, 3]
    assert deltas_by_block(events) == {i: b.text for i, b in enumerate(message.blocks)}
    assert message.reasoning_tokens == len(model_output(recipe, "Let me think."))


def test_without_thinking_everything_is_answer(recipe: ChatRecipe) -> None:
    prompt = recipe.encode_chat([{"role": "user", "content": "Hi"}])
    message = recipe.decode_chat(model_output(recipe, f"Hello there{T.EOS}"), prompt)
    assert (message.reasoning, message.content, message.tool_calls) == (None, "Hello there", [])


def test_marker_text_written_as_plain_tokens_stays_text(recipe: ChatRecipe) -> None:
    """Only control ids switch blocks: the characters '</think>' in plain tokens are answer text."""
    looks_like = f"a{T.THINK_END}b{T.TOOL_CALLS_BEGIN}c"
    ids = recipe.text.encode(looks_like)
    message = recipe.decode_chat(ids)
    assert message.content == looks_like and message.tool_calls == []


def test_multibyte_characters_split_across_tokens_never_show_half(recipe: ChatRecipe) -> None:
    text = "日本語 🙂 héllo"
    events, _ = stream(recipe, recipe.text.encode(text))
    deltas = [e.text for e in events if isinstance(e, BlockDelta)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_stop_strings_are_held_back_and_cut(recipe: ChatRecipe) -> None:
    ids = recipe.text.encode("Hello END world")
    end = next(i for i in range(len(ids)) if "END" in recipe.tokenizer.decode(ids[: i + 1]))
    events, parser = stream(recipe, ids[: end + 1], stop=("END",), stop_reason="END")
    deltas = [e.text for e in events if isinstance(e, BlockDelta)]
    assert "".join(deltas) == parser.result.content == "Hello "
    assert not any("E" in d for d in deltas)


def test_a_tool_call_cut_short_is_closed(recipe: ChatRecipe) -> None:
    ids = model_output(
        recipe, f"{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}get_weather{T.TOOL_SEP}" + '{"city": "Pa'
    )
    events, parser = stream(recipe, ids)
    assert isinstance(events[-1], BlockEnd)
    (call,) = parser.result.tool_calls
    assert call.name == "get_weather" and call.arguments == '{"city": "Pa'


def test_feed_after_finish_is_an_error(recipe: ChatRecipe) -> None:
    parser = recipe.parser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed([1])


@pytest.mark.parametrize(
    ("chunks", "stop", "released"),
    [
        (["Hel", "lo"], (), ["Hel", "lo"]),
        (["Hello E", "N", "D!"], ("END",), ["Hello ", "", ""]),  # "E", "EN" held; "END" complete: held
        (["Hello E", "x"], ("END",), ["Hello ", "Ex"]),  # "Ex" can no longer become "END"
        (["a STOPb"], ("STOP",), ["a "]),  # a complete stop string inside one chunk
    ],
)
def test_stop_string_buffer(chunks: list[str], stop: tuple[str, ...], released: list[str]) -> None:
    buffer = StopStringBuffer(stop)
    assert [buffer.push(c) for c in chunks] == released


def test_stop_string_buffer_finish_and_settle() -> None:
    buffer = StopStringBuffer(["END"])
    assert buffer.push("Hello EN") == "Hello "
    assert buffer.finish() == "EN"  # ended for another reason: the held text was answer after all
    cut = StopStringBuffer(["END"])
    cut.push("Hello EN")
    assert cut.push("D more") == "" and cut.finish("END") == "" and cut.text == "Hello "
    settled = StopStringBuffer(["END"])
    settled.push("Hello EN")
    assert settled.settle("Hello ") == "" and settled.text == "Hello "
