"""OpenAI Responses (``POST /v1/responses``): request, response object, output items.

The server is stateless: a conversation is sent whole in ``input`` (``previous_response_id`` is
refused). Thinking mode is on when ``reasoning.effort`` is low/medium/high; the reasoning comes back
as a ``reasoning`` output item with ``reasoning_text`` content.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag

from deepinfer.server.protocol.common import (
    RequestModel,
    ResponseModel,
    refuse_unsupported_parts,
    supported_parts,
)

TEXT_PARTS = ("input_text", "output_text")


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[InputText], supported_parts(TEXT_PARTS)]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(RequestModel):
    """Reasoning of an earlier turn: accepted and dropped (DeepSeek does not re-read it)."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


def _refuse_unsupported_input(value: Any) -> Any:
    """Check the input messages' content parts before the ``input`` union is matched, so an image
    is refused as such rather than as a value that is neither a string nor a list of items."""
    for j, item in enumerate(value if isinstance(value, list) else ()):
        if isinstance(item, dict) and item.get("type", "message") == "message":
            refuse_unsupported_parts(item.get("content"), TEXT_PARTS, f"input[{j}].content")
    return value


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class Reasoning(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class TextFormat(RequestModel):
    """``json_object`` / ``json_schema`` constrain the answer (structured outputs, non-thinking)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str
    input: Annotated[
        str | Annotated[list[InputItem], Field(min_length=1)], BeforeValidator(_refuse_unsupported_input)
    ]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ---------------------------------------------------------------------------------- responses
class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputReasoning(ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
