"""``POST /v1/messages``: Anthropic Messages over the DeepSeek chat recipe.

Blocks map one to one: reasoning -> ``thinking``, text -> ``text``, tool call -> ``tool_use`` (its
arguments streamed as ``input_json_delta``). ``message_start`` is sent with the first generated
tokens, when the prefix-cache hit (``cache_read_input_tokens``) is known.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deepinfer.logger import get_logger
from deepinfer.recipe import (
    AssistantMessage,
    Block,
    BlockDelta,
    BlockEnd,
    BlockStart,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    ToolSpec,
    UserMessage,
)
from deepinfer.server.api.common import (
    ChatFields,
    Serving,
    encode_conversation,
    forced_tool_grammar,
    new_id,
    offered_tools,
    respond,
    single_call_stop,
)
from deepinfer.server.context import ApiFields, traffic_class
from deepinfer.server.generation import ChatRun, ChoiceUpdate, Finish, FinishReason, Usage
from deepinfer.server.protocol import messages as p
from deepinfer.web.errors import ApiError, Dialect
from deepinfer.web.sse import sse

logger = get_logger(__name__)
router = APIRouter()

FIELDS = ApiFields(
    prompt="messages", max_tokens="max_tokens", renamed={"stop": "stop_sequences", "grammar": "tool_choice"}
)
CHAT_FIELDS = ChatFields(
    messages="messages",
    tools="tools",
    tool_choice="tool_choice",
    thinking="thinking",
    tool_parameters="tools[{i}].input_schema",
)
STOP_REASONS = {
    FinishReason.LENGTH: "max_tokens",
    FinishReason.STOP_STRING: "stop_sequence",
    FinishReason.TOOL_CALLS: "tool_use",
}


def _text(content: str | list[p.TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def to_messages(body: p.CountTokensRequest) -> list[Message]:
    """The system prompt and messages as a conversation: a user turn's ``tool_result`` blocks become
    tool messages; an assistant turn's ``tool_use`` blocks its tool calls; thinking is dropped."""
    out: list[Message] = [SystemMessage(content=_text(body.system))] if body.system else []
    for message in body.messages:
        blocks = (
            [p.TextBlock(type="text", text=message.content)]
            if isinstance(message.content, str)
            else message.content
        )
        if message.role == "assistant":
            text = "".join(b.text for b in blocks if isinstance(b, p.TextBlock))
            calls = tuple(
                ToolCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
                for b in blocks
                if isinstance(b, p.ToolUseBlock)
            )
            out.append(AssistantMessage(content=text, tool_calls=calls))
            continue
        for block in blocks:
            if isinstance(block, p.ToolResultBlock):
                out.append(ToolMessage(content=_text(block.content), tool_call_id=block.tool_use_id))
            elif isinstance(block, p.TextBlock):
                out.append(UserMessage(content=block.text))
    return out


def stop_reason(finish: Finish) -> str:
    return STOP_REASONS.get(finish.reason, "end_turn")


def _usage(usage: Usage) -> p.MessagesUsage:
    return p.MessagesUsage(
        input_tokens=usage.prompt_tokens - usage.cached_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=usage.cached_tokens,
    )


def tool_input(block: Block) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` must be ({} if the model's JSON is
    not an object; logged)."""
    try:
        value = json.loads(block.text or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        logger.warning(
            "tool call %r: the model's arguments are not a JSON object: %.200r", block.name, block.text
        )
        return {}
    return value


def _parallel(choice: p.ToolChoice | None) -> bool | None:
    """Whether parallel tool calls are allowed: False with ``disable_parallel_tool_use``."""
    return False if choice is not None and choice.disable_parallel_tool_use else None


def _tool_choice(choice: p.ToolChoice | None) -> str | None:
    """Anthropic's tool_choice in the shared vocabulary: auto, none, required, function:NAME."""
    if choice is None:
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(
                400, "tool_choice.name is required when tool_choice.type is 'tool'", param="tool_choice.name"
            )
        return f"function:{choice.name}"
    return choice.type


def _tools(body: p.CountTokensRequest, choice: str | None) -> list[ToolSpec]:
    specs = [
        ToolSpec(name=t.name, description=t.description or "", parameters=t.input_schema)
        for t in body.tools or ()
    ]
    return offered_tools(specs, choice, CHAT_FIELDS)


@router.post("/v1/messages/count_tokens", response_model=p.TokenCount)
async def count_tokens(body: p.CountTokensRequest, ctx: Serving) -> p.TokenCount:
    """The prompt tokens a Messages request with this conversation would use (Anthropic's
    ``count_tokens``); nothing is generated."""
    ctx.check_model(body.model)
    tools = _tools(body, _tool_choice(body.tool_choice))
    thinking = isinstance(body.thinking, p.ThinkingEnabled)
    prompt = await encode_conversation(ctx, to_messages(body), tools, thinking, CHAT_FIELDS)
    return p.TokenCount(input_tokens=len(prompt))


@router.post("/v1/messages", response_model=p.MessageResponse)
async def create_message(body: p.MessagesRequest, request: Request, ctx: Serving) -> Response:
    """Create a message (Anthropic Messages); ``stream: true`` streams its events as SSE."""
    ctx.check_model(body.model)
    ctx.check_admitting()
    choice = _tool_choice(body.tool_choice)
    tools = _tools(body, choice)
    thinking = isinstance(body.thinking, p.ThinkingEnabled)
    params = ctx.sampling_params(
        {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "max_tokens": body.max_tokens,
            "grammar": forced_tool_grammar(ctx, tools, choice, thinking, CHAT_FIELDS),
            "stop_token_ids": single_call_stop(ctx, tools, _parallel(body.tool_choice)),
            "traffic_class": traffic_class(body, request),
        },
        FIELDS,
    )
    prompt = await encode_conversation(ctx, to_messages(body), tools, thinking, CHAT_FIELDS)
    run = ChatRun(ctx, ctx.admit(prompt, params, FIELDS, request.state.arrival_time), prompt, params)
    return await respond(request, run, MessagesRenderer(run, ctx.model_name), bool(body.stream), FIELDS)


class MessagesRenderer:
    """The Messages response and its stream of events for a :class:`ChatRun` (one choice)."""

    def __init__(self, run: ChatRun, model: str) -> None:
        self.run = run
        self.model = model
        self.id = new_id("msg_")
        self._tool_ids: dict[int, str] = {}
        self._started = False

    def _tool_id(self, index: int) -> str:
        return self._tool_ids.setdefault(index, new_id("toolu_"))

    def _content(self, index: int, block: Block) -> p.TextOut | p.ThinkingOut | p.ToolUseOut:
        if block.kind == "reasoning":
            return p.ThinkingOut(thinking=block.text)
        if block.kind == "text":
            return p.TextOut(text=block.text)
        return p.ToolUseOut(id=self._tool_id(index), name=block.name or "", input=tool_input(block))

    def response(self) -> dict[str, Any]:
        blocks = self.run.messages[0].blocks
        finish = self.run.finishes[0]
        message = p.MessageResponse(
            id=self.id,
            model=self.model,
            content=[self._content(i, b) for i, b in enumerate(blocks)],
            stop_reason=stop_reason(finish),
            stop_sequence=finish.stop_string,
            usage=_usage(self.run.usage),
        )
        return message.model_dump(mode="json")

    # ------------------------------------------------------------------ events
    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, **fields}, event=kind)

    def _message_start(self) -> list[str]:
        if self._started:
            return []
        self._started = True
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.run.usage).model_dump(mode="json"),
        }
        return [self._event("message_start", message=message)]

    def start(self) -> list[str]:
        return []

    def update(self, update: ChoiceUpdate) -> list[str]:
        events = self._message_start()
        blocks = self.run.messages[0].blocks
        for event in update.events:
            index, block = event.index, blocks[event.index]
            if isinstance(event, BlockStart):
                start: dict[str, Any]
                if block.kind == "tool_call":
                    start = {
                        "type": "tool_use",
                        "id": self._tool_id(index),
                        "name": block.name or "",
                        "input": {},
                    }
                elif block.kind == "reasoning":
                    start = {"type": "thinking", "thinking": "", "signature": ""}
                else:
                    start = {"type": "text", "text": ""}
                events.append(self._event("content_block_start", index=index, content_block=start))
            elif isinstance(event, BlockDelta):
                if block.kind == "tool_call":
                    delta = {"type": "input_json_delta", "partial_json": event.text}
                elif block.kind == "reasoning":
                    delta = {"type": "thinking_delta", "thinking": event.text}
                else:
                    delta = {"type": "text_delta", "text": event.text}
                events.append(self._event("content_block_delta", index=index, delta=delta))
            elif isinstance(event, BlockEnd):
                events.append(self._event("content_block_stop", index=index))
        return events

    def end(self, usage: Usage) -> list[str]:
        finish = self.run.finishes[0]
        delta = {"stop_reason": stop_reason(finish), "stop_sequence": finish.stop_string}
        return [
            *self._message_start(),
            self._event("message_delta", delta=delta, usage=_usage(usage).model_dump(mode="json")),
            self._event("message_stop"),
        ]

    def error(self, error: ApiError) -> list[str]:
        return [sse(error.body(Dialect.ANTHROPIC), event="error")]
