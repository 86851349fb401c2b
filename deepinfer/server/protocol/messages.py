"""Anthropic Messages (``POST /v1/messages``): request, response message and content blocks.

Thinking mode is on with ``thinking: {"type": "enabled", ...}``; the reasoning comes back as a
``thinking`` block (with an empty signature: it is not signed). ``usage.input_tokens`` counts the
prompt tokens that were not served from the prefix cache; those are ``cache_read_input_tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from deepinfer.server.protocol.common import RequestModel, ResponseModel, StopString, supported_parts


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock], supported_parts(["text"])] = ""
    is_error: bool | None = None


class ThinkingBlock(RequestModel):
    """Thinking of an earlier turn: accepted and dropped (DeepSeek does not re-read it)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[ContentBlock], supported_parts(BLOCK_TYPES)]


class ToolDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


class CountTokensRequest(RequestModel):
    """``POST /v1/messages/count_tokens``: the conversation part of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")] | None = None


class TokenCount(ResponseModel):
    input_tokens: int


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[StopString] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------- responses
class TextOut(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessagesUsage
