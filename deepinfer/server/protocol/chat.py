"""OpenAI Chat Completions (``POST /v1/chat/completions``): request, response and stream chunk.

Reasoning is returned as ``reasoning_content`` (DeepSeek's and vLLM's name). Thinking mode is on
when ``reasoning_effort`` is low/medium/high or ``chat_template_kwargs.thinking`` is true.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from deepinfer.server.protocol.common import (
    OpenAISampling,
    OpenAIUsage,
    RequestModel,
    ResponseModel,
    supported_parts,
)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], supported_parts(["text"])]


class FunctionCall(RequestModel):
    name: str
    arguments: str


class ToolCallIn(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(RequestModel):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Content


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """``json_object`` / ``json_schema`` constrain the answer (structured outputs, non-thinking)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(OpenAISampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------------------- responses
class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls
    refusal: None = None  # always null: the server has no refusal channel
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Choice(ResponseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: OpenAIUsage


class FunctionCallDelta(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: OpenAIUsage | None = None
