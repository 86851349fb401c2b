"""The conversation a chat recipe encodes, independent of any HTTP API.

The server turns OpenAI Chat Completions / Responses and Anthropic Messages requests into these;
``encode_chat`` also accepts plain dicts of the same shape (``{"role": "user", "content": "hi"}``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolSpec(_Frozen):
    """A function the model may call: its name, what it does, and a JSON Schema of its arguments."""

    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Frozen):
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str = "{}"


class SystemMessage(_Frozen):
    role: Literal["system"] = "system"
    content: str


class UserMessage(_Frozen):
    role: Literal["user"] = "user"
    content: str


class AssistantMessage(_Frozen):
    """An earlier model turn. ``reasoning`` is accepted but not re-encoded: DeepSeek drops the
    thinking of past turns. As the last message it is a prefix the model continues."""

    role: Literal["assistant"] = "assistant"
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class ToolMessage(_Frozen):
    """The result of one tool call."""

    role: Literal["tool"] = "tool"
    content: str
    tool_call_id: str | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]

_MESSAGES: TypeAdapter[list[Message]] = TypeAdapter(list[Message])
_TOOLS: TypeAdapter[list[ToolSpec]] = TypeAdapter(list[ToolSpec])


def as_messages(messages: Iterable[Message | dict[str, Any]]) -> list[Message]:
    """Validate messages given as models or dicts (``ValueError`` names the offending field)."""
    return _MESSAGES.validate_python(list(messages))


def as_tools(tools: Iterable[ToolSpec | dict[str, Any]] | None) -> list[ToolSpec]:
    return _TOOLS.validate_python(list(tools or ()))
