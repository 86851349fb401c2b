"""Reading a DeepSeek completion back: reasoning, answer text and tool calls, incrementally.

The parser consumes generated token ids. Control tokens are recognised by id, so a marker is
either seen whole or not at all: a partial marker can never leak into the text, and text the model
wrote that merely looks like a marker stays text. The output is a sequence of blocks, each opened,
filled with text deltas and closed::

    <think>…</think>                               -> a "reasoning" block
    plain text                                     -> a "text" block
    <｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜> -> a "tool_call" block (name at start,
                                                      the arguments as deltas)

Text is detokenized incrementally (never half a UTF-8 character) and, when the request has stop
strings, held back while it could still become one (see :mod:`deepinfer.recipe.stop_strings`).
Control tokens the format does not use here (EOS, BOS, ``<｜User｜>`` ...) are dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.recipe import tokens as T
from deepinfer.recipe.messages import ToolCall
from deepinfer.recipe.stop_strings import StopStringBuffer
from deepinfer.recipe.tokens import ControlTokens
from deepinfer.tokenizer import Tokenizer

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass(frozen=True, slots=True)
class BlockStart:
    index: int
    kind: BlockKind
    name: str | None = None  # the function's name, for tool calls


@dataclass(frozen=True, slots=True)
class BlockDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class BlockEnd:
    index: int


ChatEvent = BlockStart | BlockDelta | BlockEnd


@dataclass(slots=True)
class Block:
    kind: BlockKind
    text: str = ""  # reasoning or answer text; a tool call's arguments
    name: str | None = None


@dataclass(slots=True)
class ParsedMessage:
    """A completion read back: its blocks in order, and the usual views of them."""

    blocks: list[Block] = field(default_factory=list)
    reasoning_tokens: int = 0  # generated tokens that were reasoning text

    @property
    def reasoning(self) -> str | None:
        parts = [b.text for b in self.blocks if b.kind == "reasoning"]
        return "".join(parts) if parts else None

    @property
    def content(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [
            ToolCall(name=b.name or "", arguments=b.text.strip())
            for b in self.blocks
            if b.kind == "tool_call"
        ]


class _State(enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALLS = "between tool calls"
    TOOL_NAME = "tool name"
    TOOL_ARGUMENTS = "tool arguments"


_KIND_OF_STATE: dict[_State, BlockKind] = {
    _State.REASONING: "reasoning",
    _State.TEXT: "text",
    _State.TOOL_ARGUMENTS: "tool_call",
}


class ChatOutputParser:
    """Incremental parser for one completion. ``feed`` the new token ids as they are generated,
    then ``finish`` once; each returns the events they produced. ``result`` is the message so far."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        control: ControlTokens,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        """``tokenizer`` decodes text and tool names; ``control`` names the chat template's control
        tokens (``ChatRecipe.parser`` passes its own)."""
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._marker_of = {i: m for m, i in control.ids.items()}
        self._control_ids = control.all_ids
        think = control.ids.get(T.THINK_BEGIN)
        starts_thinking = bool(prompt_token_ids) and prompt_token_ids[-1] == think
        self._state = _State.REASONING if starts_thinking else _State.TEXT
        self.result = ParsedMessage()
        self._open: Block | None = None
        self._open_index = -1
        self._detok: IncrementalDetokenizer | None = None
        self._buffer: StopStringBuffer | None = None
        self._name_ids: list[int] = []
        self._finished = False

    def feed(self, token_ids: Sequence[int]) -> list[ChatEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        events: list[ChatEvent] = []
        for token in token_ids:
            if token in self._control_ids:
                self._control(self._marker_of.get(token), events)
            elif self._state is _State.TOOL_NAME:
                self._name_ids.append(token)
            elif self._state is not _State.TOOL_CALLS:  # stray text between tool calls is dropped
                if self._state is _State.REASONING:
                    self.result.reasoning_tokens += 1
                self._text(token, events)
        return events

    def finish(self, stop_reason: str | int | None = None) -> list[ChatEvent]:
        """End of generation. ``stop_reason``: the stop string that ended it, if any (cut off)."""
        events: list[ChatEvent] = []
        if not self._finished:
            self._finished = True
            self._close(events, stop_reason if isinstance(stop_reason, str) else None)
        return events

    # ------------------------------------------------------------------ internals
    def _control(self, marker: str | None, events: list[ChatEvent]) -> None:
        state = self._state
        if marker == T.THINK_BEGIN:
            self._switch(_State.REASONING, events)
        elif marker in (T.THINK_END, T.TOOL_CALLS_END):
            self._switch(_State.TEXT, events)
        elif marker in (T.TOOL_CALLS_BEGIN, T.TOOL_CALL_END):
            self._switch(_State.TOOL_CALLS, events)
        elif marker == T.TOOL_CALL_BEGIN:
            self._switch(_State.TOOL_NAME, events)
            self._name_ids = []
        elif marker == T.TOOL_SEP and state is _State.TOOL_NAME:
            name = self._tokenizer.decode(self._name_ids, skip_special_tokens=False).strip()
            self._state = _State.TOOL_ARGUMENTS
            self._start(Block("tool_call", name=name), events)

    def _switch(self, state: _State, events: list[ChatEvent]) -> None:
        self._close(events, None)
        self._state = state

    def _text(self, token: int, events: list[ChatEvent]) -> None:
        if self._detok is None:
            self._detok = IncrementalDetokenizer(self._tokenizer, [], skip_special_tokens=False)
            self._buffer = StopStringBuffer(self._stop)
        self._emit(self._buffer.push(self._detok.add(token)), events)

    def _emit(self, text: str, events: list[ChatEvent]) -> None:
        if not text:
            return
        if self._open is None:
            self._start(Block(_KIND_OF_STATE[self._state]), events)
        self._open.text += text
        events.append(BlockDelta(self._open_index, text))

    def _start(self, block: Block, events: list[ChatEvent]) -> None:
        self.result.blocks.append(block)
        self._open, self._open_index = block, len(self.result.blocks) - 1
        events.append(BlockStart(self._open_index, block.kind, block.name))

    def _close(self, events: list[ChatEvent], stop_reason: str | None) -> None:
        """End the current span: release held-back text, close the open block."""
        if self._detok is not None:
            self._buffer.push(self._detok.flush())
            self._emit(self._buffer.finish(stop_reason), events)
            self._detok = self._buffer = None
        if self._open is not None:
            events.append(BlockEnd(self._open_index))
            self._open = None
