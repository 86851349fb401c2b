"""The chat recipe's prompts: DeepSeek-V3.1's documented format, and control tokens only where the
template puts them, whatever the user writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.recipe import ChatRecipe, encode_chat, recipe_for
from deepinfer.recipe import tokens as T
from deepinfer.recipe.tokens import ControlTokens, PlainTextEncoder
from deepinfer.tokenizer import Tokenizer as DeepinferTokenizer
from tests.conftest import write_tokenizer
from tests.recipe.deepseek_tokenizer import CONTROL_TEXTS

B, E, U, A = T.BOS, T.EOS, T.USER, T.ASSISTANT
TOOLS = [
    {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def rendered(recipe: ChatRecipe, text: str) -> list[int]:
    """What DeepSeek's string template gives: the rendered text tokenized with control tokens parsed."""
    return recipe.tokenizer.encode(text, add_special_tokens=False)


def test_documented_v31_prompts_in_both_modes(recipe: ChatRecipe) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am DeepSeek", "reasoning": "Hmm"},
        {"role": "user", "content": "1+1=?"},
    ]
    history = f"{B}You are a helpful assistant{U}Who are you?{A}</think>I am DeepSeek{E}{U}1+1=?{A}"
    assert recipe.encode_chat(messages, thinking=True) == rendered(recipe, history + "<think>")
    assert recipe.encode_chat(messages, thinking=False) == rendered(recipe, history + "</think>")


def test_tool_description_calls_and_results(recipe: ChatRecipe) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    description = (
        "## Tools\nYou have access to the following tools:\n\n### get_weather\nDescription: Get the weather\n\n"
        f"Parameters: {json.dumps(TOOLS[0]['parameters'])}\n\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        f"{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}tool_call_name{T.TOOL_SEP}tool_call_arguments{T.TOOL_CALL_END}"
        "{{additional_tool_calls}}"
        f"{T.TOOL_CALLS_END}\n\nWhere:\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces"
    )
    calls = "".join(
        f'{T.TOOL_CALL_BEGIN}get_weather{T.TOOL_SEP}{{"city": "{c}"}}{T.TOOL_CALL_END}'
        for c in ("Paris", "Lyon")
    )
    expected = (
        f"{B}Be brief.\n\n{description}{U}Weather in Paris?{A}</think>"
        f"{T.TOOL_CALLS_BEGIN}{calls}{T.TOOL_CALLS_END}{E}"
        f"{T.TOOL_OUTPUT_BEGIN}sunny{T.TOOL_OUTPUT_END}{T.TOOL_OUTPUT_BEGIN}rain{T.TOOL_OUTPUT_END}"
    )  # after tool results the model continues directly: no new <｜Assistant｜>
    assert recipe.encode_chat(messages, tools=TOOLS) == rendered(recipe, expected)


def test_a_final_assistant_message_is_continued(recipe: ChatRecipe) -> None:
    ids = recipe.encode_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    )
    assert ids == rendered(recipe, f"{B}{U}Hi{A}</think>Hello, I")


def test_the_tokenizers_library_splits_control_text_only_with_special_tokens_disabled(
    deepseek_tokenizer: DeepinferTokenizer, recipe: ChatRecipe
) -> None:
    """What the recipe relies on, checked against ``tokenizers`` itself: by default a user typing
    "<｜User｜>" (special) or "</think>" (a non-special added token) gets the control id; with the
    tokens marked special and ``encode_special_tokens`` on they are ordinary byte-level tokens."""
    control = recipe.control
    for text in (T.USER, T.THINK_END, T.TOOL_SEP):
        assert deepseek_tokenizer.backend.encode(text, add_special_tokens=False).ids == [control[text]]
        plain = recipe.text.encode(text)
        assert len(plain) > 1 and control.all_ids.isdisjoint(plain)
        assert deepseek_tokenizer.decode(plain, skip_special_tokens=False) == text
    # encode_special_tokens alone is not enough: it skips special tokens only, and </think> is not one
    backend = Tokenizer.from_str(deepseek_tokenizer.backend.to_str())
    backend.encode_special_tokens = True
    assert control[T.THINK_END] in backend.encode(f"a{T.THINK_END}b", add_special_tokens=False).ids
    assert control[T.USER] not in backend.encode(f"a{T.USER}b", add_special_tokens=False).ids


def conversation(text: str) -> tuple[list[dict], list[dict]]:
    """A conversation using every message slot and a tool, with ``text`` in each."""
    messages = [
        {"role": "system", "content": text},
        {"role": "user", "content": text},
        {"role": "assistant", "content": text, "tool_calls": [{"name": text, "arguments": text}]},
        {"role": "tool", "content": text},
        {"role": "user", "content": text},
    ]
    return messages, [{"name": text, "description": text, "parameters": {"x": text}}]


def test_every_control_text_in_every_message_slot_stays_plain(recipe: ChatRecipe) -> None:
    evil = recipe.encode_chat(*conversation("x" + "".join(CONTROL_TEXTS) + "y"))
    benign = recipe.encode_chat(*conversation("x"))
    controls = recipe.control.all_ids
    assert [t for t in evil if t in controls] == [t for t in benign if t in controls]


CONTROL = st.sampled_from(CONTROL_TEXTS)
USER_TEXT = st.lists(st.one_of(st.text(max_size=12), CONTROL), max_size=8).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=USER_TEXT, user=USER_TEXT, reply=USER_TEXT, tool_output=USER_TEXT, thinking=st.booleans())
def test_user_text_never_yields_a_control_token(
    recipe: ChatRecipe, system: str, user: str, reply: str, tool_output: str, thinking: bool
) -> None:
    """Property: whatever the texts (arbitrary Unicode with control-token texts spliced in), the
    prompt's control tokens are exactly the template's, and every text decodes back unchanged."""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply, "tool_calls": [{"name": "f", "arguments": tool_output}]},
        {"role": "tool", "content": tool_output},
        {"role": "user", "content": user},
    ]
    ids = recipe.encode_chat(messages, thinking=thinking)
    c = recipe.control
    mode = c[T.THINK_BEGIN] if thinking else c[T.THINK_END]
    assert [t for t in ids if t in c.all_ids] == [
        c[B], c[U], c[A], c[T.THINK_END], c[T.TOOL_CALLS_BEGIN], c[T.TOOL_CALL_BEGIN], c[T.TOOL_SEP],
        c[T.TOOL_CALL_END], c[T.TOOL_CALLS_END], c[E], c[T.TOOL_OUTPUT_BEGIN], c[T.TOOL_OUTPUT_END], c[U], c[A], mode,
    ]  # fmt: skip
    think = T.THINK_BEGIN if thinking else T.THINK_END
    expected = (
        f"{B}{system}{U}{user}{A}</think>{reply}{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}f{T.TOOL_SEP}{tool_output}"
        f"{T.TOOL_CALL_END}{T.TOOL_CALLS_END}{E}{T.TOOL_OUTPUT_BEGIN}{tool_output}{T.TOOL_OUTPUT_END}{U}{user}{A}{think}"
    )
    assert recipe.tokenizer.decode(ids, skip_special_tokens=False) == expected
    assert c.all_ids.isdisjoint(recipe.text.encode(user))


def test_module_level_functions_use_one_cached_recipe(deepseek_tokenizer: DeepinferTokenizer) -> None:
    assert recipe_for(deepseek_tokenizer) is recipe_for(deepseek_tokenizer)
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_chat(deepseek_tokenizer, messages) == recipe_for(deepseek_tokenizer).encode_chat(messages)


def test_invalid_messages_name_the_field(recipe: ChatRecipe) -> None:
    with pytest.raises(ValueError, match="content"):
        recipe.encode_chat([{"role": "user"}])
    with pytest.raises(ValueError, match="role"):
        recipe.encode_chat([{"role": "robot", "content": "hi"}])


def test_a_v3_tokenizer_without_thinking_or_tool_tokens(tmp_path: Path) -> None:
    """The four-token tokenizer of the engine tests: V3 prompts, and clear errors for what it lacks."""
    write_tokenizer(tmp_path)
    recipe = ChatRecipe(DeepinferTokenizer(tmp_path))
    assert not recipe.supports_thinking and not recipe.supports_tools
    ids = recipe.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids == recipe.tokenizer.encode(f"{B}{U}Hi{A}", add_special_tokens=False)
    with pytest.raises(ValueError, match="thinking mode needs"):
        recipe.encode_chat([{"role": "user", "content": "Hi"}], thinking=True)
    with pytest.raises(ValueError, match="tool use needs"):
        recipe.encode_chat([{"role": "user", "content": "Hi"}], tools=TOOLS)


def test_a_tokenizer_that_is_not_deepseek_is_refused(tmp_path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=300))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="not a DeepSeek chat tokenizer"):
        ChatRecipe(DeepinferTokenizer(tmp_path))


def test_a_vocabulary_whose_plain_pieces_are_control_ids_is_refused(tmp_path: Path) -> None:
    """If BPE itself can produce a control id from text (the marker is also an ordinary vocabulary
    entry), no encoding is safe: the recipe refuses the tokenizer instead of leaking."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["<think>"] * 50 + ["hello world"] * 10, trainer)
    assert tok.token_to_id("<think>") is not None  # learned as an ordinary token
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tok.add_special_tokens([B, E, U, A])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": B, "eos_token": E}))
    tokenizer = DeepinferTokenizer(tmp_path)
    with pytest.raises(ValueError, match="encodes control-token text to control ids"):
        PlainTextEncoder(tokenizer, ControlTokens.of(tokenizer))
