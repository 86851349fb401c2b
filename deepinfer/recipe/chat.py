"""DeepSeek's chat format (V3.1, with V3 fallbacks): a conversation in, prompt token ids out.

The prompt is assembled from token-id segments: control ids the template chooses, and text encoded
as plain text (:class:`~deepinfer.recipe.tokens.PlainTextEncoder`). It is never rendered to a string
and re-tokenized, so text inside a message can never become a control token. Adjacent text pieces
are joined before encoding, so for ordinary text the ids equal those of tokenizing DeepSeek's
rendered template; every text piece of a conversation is encoded in one parallel batch.

Format (V3.1)::

    <BOS>{system}[\\n\\n{tool description}]
    <｜User｜>{user}<｜Assistant｜></think>{answer}[tool calls]<｜end▁of▁sentence｜>
    <｜tool▁output▁begin｜>{tool result}<｜tool▁output▁end｜>  ...
    <｜User｜>{user}<｜Assistant｜><think>      (generation prompt, thinking mode)
    <｜User｜>{user}<｜Assistant｜></think>     (generation prompt, non-thinking mode)

A tool call is ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``. The reasoning of earlier turns is dropped. After tool
results the model continues directly (no new ``<｜Assistant｜>``). A final assistant message is a
prefix the model continues. Tokenizers without ``</think>`` (DeepSeek-V3) get V3's prompts.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from deepinfer.recipe import tokens as T
from deepinfer.recipe.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolMessage,
    ToolSpec,
    UserMessage,
    as_messages,
    as_tools,
)
from deepinfer.recipe.parser import ChatOutputParser, ParsedMessage
from deepinfer.recipe.tokens import ControlTokens, plain_text_encoder
from deepinfer.tokenizer import Tokenizer

Part = int | str  # a control token id, or text to encode as plain text

TOOL_FORMAT_RULES = (
    "\n\nWhere:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces"
)


class ChatRecipe:
    """The chat format of one tokenizer: ``encode_chat`` builds prompts, ``parser`` reads outputs.

    Raises ``ValueError`` if the tokenizer lacks DeepSeek's conversation tokens (BOS, EOS,
    ``<｜User｜>``, ``<｜Assistant｜>``). Thinking needs ``<think>``/``</think>``; tools need the
    tool-call and tool-output markers (``supports_thinking`` / ``supports_tools`` say which).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.control = ControlTokens.of(tokenizer)
        missing = [m for m in (T.BOS, T.EOS, T.USER, T.ASSISTANT) if not self.control.has(m)]
        if missing:
            raise ValueError(
                f"the tokenizer is not a DeepSeek chat tokenizer: it has no {', '.join(missing)}"
            )
        self.text = plain_text_encoder(tokenizer)

    @property
    def supports_thinking(self) -> bool:
        return self.control.has(*T.THINKING_MARKERS)

    @property
    def supports_tools(self) -> bool:
        return self.control.has(*T.TOOL_MARKERS, *T.TOOL_OUTPUT_MARKERS)

    # ------------------------------------------------------------------ encoding
    def encode_chat(
        self,
        messages: Iterable[Message | dict[str, Any]],
        tools: Iterable[ToolSpec | dict[str, Any]] | None = None,
        thinking: bool = False,
    ) -> list[int]:
        """Prompt token ids for ``messages``, ending with the generation prompt (``<｜Assistant｜>``
        and ``<think>`` or ``</think>``) when the last message is the user's.

        ``tools`` are described in the system prompt; ``thinking`` selects thinking mode. Raises
        ``ValueError`` for invalid messages or features the tokenizer lacks.
        """
        parts = self.render(as_messages(messages), as_tools(tools), thinking)
        return self.assemble(parts)

    def assemble(self, parts: Sequence[Part]) -> list[int]:
        """Join adjacent text parts, encode all of them in one batch, splice in the control ids."""
        merged: list[Part] = []
        for part in parts:
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            elif part != "":
                merged.append(part)
        encoded = iter(self.text.encode_batch([p for p in merged if isinstance(p, str)]))
        ids: list[int] = []
        for part in merged:
            if isinstance(part, str):
                ids += next(encoded)
            else:
                ids.append(part)
        return ids

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSpec], thinking: bool) -> list[Part]:
        """The prompt as parts (control ids and text), before encoding."""
        c = self.control
        if thinking and not self.supports_thinking:
            raise ValueError("thinking mode needs <think> and </think> tokens, which this tokenizer lacks")
        uses_tools = tools or any(
            isinstance(m, ToolMessage) or (isinstance(m, AssistantMessage) and m.tool_calls) for m in messages
        )
        if uses_tools and not self.supports_tools:
            raise ValueError("tool use needs DeepSeek's tool-call tokens, which this tokenizer lacks")

        system = "\n\n".join(m.content for m in messages if isinstance(m, SystemMessage))
        parts: list[Part] = [c[T.BOS], system]
        if tools:
            parts += ["\n\n" if system else "", *self._describe_tools(tools)]
        answer_mode = [c[T.THINK_END]] if self.supports_thinking else []
        previous = None
        turns = [m for m in messages if not isinstance(m, SystemMessage)]
        for position, message in enumerate(turns):
            last = position == len(turns) - 1
            if isinstance(message, UserMessage):
                parts += [c[T.USER], message.content]
            elif isinstance(message, ToolMessage):
                parts += [c[T.TOOL_OUTPUT_BEGIN], message.content, c[T.TOOL_OUTPUT_END]]
            else:
                if previous == "user":
                    parts += [c[T.ASSISTANT], *answer_mode]
                parts.append(message.content)
                parts += self._tool_calls(message)
                if not last:
                    parts.append(c[T.EOS])
            previous = message.role
        if previous == "user":
            parts += [c[T.ASSISTANT], c[T.THINK_BEGIN]] if thinking else [c[T.ASSISTANT], *answer_mode]
        return parts

    def _tool_calls(self, message: AssistantMessage) -> list[Part]:
        if not message.tool_calls:
            return []
        c = self.control
        parts: list[Part] = [c[T.TOOL_CALLS_BEGIN]]
        for call in message.tool_calls:
            parts += [c[T.TOOL_CALL_BEGIN], call.name, c[T.TOOL_SEP], call.arguments, c[T.TOOL_CALL_END]]
        parts.append(c[T.TOOL_CALLS_END])
        return parts

    def _describe_tools(self, tools: Sequence[ToolSpec]) -> list[Part]:
        """DeepSeek-V3.1's tool description, which shows the call format with the real markers."""
        c = self.control
        parts: list[Part] = ["## Tools\nYou have access to the following tools:\n"]
        for tool in tools:
            parts.append(
                f"\n### {tool.name}\nDescription: {tool.description}\n\n"
                f"Parameters: {json.dumps(tool.parameters)}\n"
            )
        parts += [
            "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n",
            c[T.TOOL_CALLS_BEGIN],
            c[T.TOOL_CALL_BEGIN],
            "tool_call_name",
            c[T.TOOL_SEP],
            "tool_call_arguments",
            c[T.TOOL_CALL_END],
            "{{additional_tool_calls}}",
            c[T.TOOL_CALLS_END],
            TOOL_FORMAT_RULES,
        ]
        return parts

    # ------------------------------------------------------------------ decoding
    def parser(self, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> ChatOutputParser:
        """An incremental parser for one completion of ``prompt_token_ids`` (a prompt ending in
        ``<think>`` starts in reasoning). ``stop``: the request's stop strings, held back while streaming."""
        return ChatOutputParser(self.tokenizer, self.control, prompt_token_ids, stop)

    def decode_chat(self, token_ids: Sequence[int], prompt_token_ids: Sequence[int] = ()) -> ParsedMessage:
        """Parse a whole completion into reasoning, answer and tool calls."""
        parser = self.parser(prompt_token_ids)
        parser.feed(token_ids)
        parser.finish()
        return parser.result


_RECIPES: weakref.WeakKeyDictionary[Tokenizer, ChatRecipe] = weakref.WeakKeyDictionary()


def recipe_for(tokenizer: Tokenizer) -> ChatRecipe:
    """The (cached) recipe of a tokenizer."""
    recipe = _RECIPES.get(tokenizer)
    if recipe is None:
        recipe = _RECIPES[tokenizer] = ChatRecipe(tokenizer)
    return recipe


def encode_chat(
    tokenizer: Tokenizer,
    messages: Iterable[Message | dict[str, Any]],
    tools: Iterable[ToolSpec | dict[str, Any]] | None = None,
    thinking: bool = False,
) -> list[int]:
    """``ChatRecipe.encode_chat`` with the tokenizer's cached recipe."""
    return recipe_for(tokenizer).encode_chat(messages, tools, thinking)


def decode_chat(
    tokenizer: Tokenizer, token_ids: Sequence[int], prompt_token_ids: Sequence[int] = ()
) -> ParsedMessage:
    """``ChatRecipe.decode_chat`` with the tokenizer's cached recipe."""
    return recipe_for(tokenizer).decode_chat(token_ids, prompt_token_ids)
