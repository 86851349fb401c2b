"""``POST /v1/responses``: OpenAI Responses over the DeepSeek chat recipe (stateless).

Each parsed block is one output item: reasoning -> ``reasoning`` (``reasoning_text`` content),
text -> ``message`` (``output_text``), tool call -> ``function_call``. Streaming follows the
Responses event sequence (``response.created`` ... ``response.completed``), every event carrying a
``sequence_number``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

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
    output_schema,
    respond,
    single_call_stop,
)
from deepinfer.server.context import ApiFields, traffic_class
from deepinfer.server.generation import ChatRun, ChoiceUpdate, Finish, FinishReason, Usage
from deepinfer.server.protocol import responses as p
from deepinfer.web.errors import ApiError, Dialect
from deepinfer.web.sse import sse

router = APIRouter()

FIELDS = ApiFields(
    prompt="input",
    max_tokens="max_output_tokens",
    renamed={"json_schema": "text.format", "grammar": "tool_choice"},
)
CHAT_FIELDS = ChatFields(
    messages="input",
    tools="tools",
    tool_choice="tool_choice",
    thinking="reasoning.effort",
    tool_parameters="tools[{i}].parameters",
)
THINKING_EFFORTS = ("low", "medium", "high")


def to_messages(body: p.ResponsesRequest) -> list[Message]:
    """``instructions`` + ``input`` as a conversation; consecutive function calls (and the assistant
    message before them) form one assistant turn."""
    out: list[Message] = [SystemMessage(content=body.instructions)] if body.instructions else []
    items = [p.MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, p.MessageItem):
            text = item.content if isinstance(item.content, str) else "\n".join(c.text for c in item.content)
            if item.role == "user":
                out.append(UserMessage(content=text))
            elif item.role == "assistant":
                out.append(AssistantMessage(content=text))
            else:
                out.append(SystemMessage(content=text))
        elif isinstance(item, p.FunctionCallItem):
            call = ToolCall(name=item.name, arguments=item.arguments)
            last = out[-1] if out else None
            if isinstance(last, AssistantMessage):
                out[-1] = last.model_copy(update={"tool_calls": (*last.tool_calls, call)})
            else:
                out.append(AssistantMessage(tool_calls=(call,)))
        elif isinstance(item, p.FunctionCallOutputItem):
            out.append(ToolMessage(content=item.output, tool_call_id=item.call_id))
    return out


def _refuse_unsupported(body: p.ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id is not supported: this server stores no responses; send the whole conversation "
            "in input",
            param="previous_response_id",
        )


@router.post("/v1/responses", response_model=p.ResponseObject)
async def create_response(body: p.ResponsesRequest, request: Request, ctx: Serving) -> Response:
    """Create a model response (OpenAI Responses); ``stream: true`` streams its events as SSE."""
    ctx.check_model(body.model)
    ctx.check_admitting()
    _refuse_unsupported(body)
    choice = (
        body.tool_choice if isinstance(body.tool_choice, str | None) else f"function:{body.tool_choice.name}"
    )
    specs = [
        ToolSpec(name=t.name, description=t.description or "", parameters=t.parameters or {})
        for t in body.tools or ()
    ]
    tools = offered_tools(specs, choice, CHAT_FIELDS)
    thinking = body.reasoning is not None and body.reasoning.effort in THINKING_EFFORTS
    fmt = body.text.format if body.text else None
    schema = (
        output_schema(
            fmt.type, fmt.schema_, "text.format", "text.format.schema", thinking, tools, bool(fmt.strict)
        )
        if fmt
        else None
    )
    params = ctx.sampling_params(
        {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_tokens": body.max_output_tokens,
            "json_schema": schema,
            "grammar": forced_tool_grammar(ctx, tools, choice, thinking, CHAT_FIELDS),
            "stop_token_ids": single_call_stop(ctx, tools, body.parallel_tool_calls),
            "traffic_class": traffic_class(body, request),
        },
        FIELDS,
    )
    prompt = await encode_conversation(ctx, to_messages(body), tools, thinking, CHAT_FIELDS)
    run = ChatRun(ctx, ctx.admit(prompt, params, FIELDS, request.state.arrival_time), prompt, params)
    return await respond(
        request, run, ResponsesRenderer(run, ctx.model_name, body), bool(body.stream), FIELDS
    )


class ResponsesRenderer:
    """The Responses object and its stream of events for a :class:`ChatRun` (one choice)."""

    def __init__(self, run: ChatRun, model: str, body: p.ResponsesRequest) -> None:
        self.run = run
        self.model = model
        self.body = body
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self._sequence = 0
        self._item_ids: dict[int, tuple[str, str | None]] = {}  # block index -> (item id, call id)

    # ------------------------------------------------------------------ objects
    def _ids(self, index: int, block: Block) -> tuple[str, str | None]:
        if index not in self._item_ids:
            prefix = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}[block.kind]
            self._item_ids[index] = (new_id(prefix), new_id("call_") if block.kind == "tool_call" else None)
        return self._item_ids[index]

    def _item(self, index: int, status: str) -> p.OutputItem:
        block = self.run.messages[0].blocks[index]
        item_id, call_id = self._ids(index, block)
        started = status == "in_progress"  # the item as first announced: no content yet
        if block.kind == "reasoning":
            content = [] if started else [p.ReasoningText(text=block.text)]
            return p.OutputReasoning(id=item_id, status=status, content=content)
        if block.kind == "text":
            return p.OutputMessage(
                id=item_id, status=status, content=[] if started else [p.OutputText(text=block.text)]
            )
        arguments = "" if started else block.text.strip()
        return p.OutputFunctionCall(
            id=item_id, call_id=call_id, name=block.name or "", arguments=arguments, status=status
        )

    def _response(self, usage: Usage | None) -> p.ResponseObject:
        """The response object: in progress without ``usage``, finished (completed, or incomplete
        when the token limit cut it short) with it."""
        status, output, incomplete = "in_progress", [], None
        if usage is not None:
            truncated = _truncated(self.run.finishes[0])
            status = "incomplete" if truncated else "completed"
            incomplete = p.IncompleteDetails(reason="max_output_tokens") if truncated else None
            last = len(self.run.messages[0].blocks) - 1
            output = [self._item(i, _item_status(truncated, i == last)) for i in range(last + 1)]
        body = self.body
        return p.ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            model=self.model,
            output=output,
            usage=_usage(usage) if usage is not None else None,
            incomplete_details=incomplete,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            tools=body.tools or [],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            metadata=body.metadata or {},
        )

    def response(self) -> dict[str, Any]:
        return self._response(self.run.usage).model_dump(mode="json")

    # ------------------------------------------------------------------ events
    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(data, event=kind)

    def start(self) -> list[str]:
        response = self._response(None).model_dump(mode="json")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def update(self, update: ChoiceUpdate) -> list[str]:
        blocks = self.run.messages[0].blocks
        events = []
        for event in update.events:
            index = event.index
            block = blocks[index]
            item_id, _ = self._ids(index, block)
            where = {"item_id": item_id, "output_index": index}
            if isinstance(event, BlockStart):
                item = self._item(index, "in_progress").model_dump(mode="json")
                events.append(self._event("response.output_item.added", output_index=index, item=item))
                if block.kind != "tool_call":
                    events.append(
                        self._event(
                            "response.content_part.added", **where, content_index=0, part=_part(block, "")
                        )
                    )
            elif isinstance(event, BlockDelta):
                if block.kind == "tool_call":
                    events.append(
                        self._event("response.function_call_arguments.delta", **where, delta=event.text)
                    )
                elif block.kind == "reasoning":
                    events.append(
                        self._event(
                            "response.reasoning_text.delta", **where, content_index=0, delta=event.text
                        )
                    )
                else:
                    events.append(
                        self._event(
                            "response.output_text.delta",
                            **where,
                            content_index=0,
                            delta=event.text,
                            logprobs=[],
                        )
                    )
            elif isinstance(event, BlockEnd):
                # the blocks a finish closes come with it: the last one is what the limit cut
                cut = _truncated(update.finish) and index == len(blocks) - 1
                events += self._close_item(index, block, where, _item_status(cut, cut))
        return events

    def _close_item(self, index: int, block: Block, where: dict[str, Any], status: str) -> list[str]:
        item = self._item(index, status).model_dump(mode="json")
        if block.kind == "tool_call":
            done = self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            return [done, self._event("response.output_item.done", output_index=index, item=item)]
        kind = "response.reasoning_text.done" if block.kind == "reasoning" else "response.output_text.done"
        extra = {} if block.kind == "reasoning" else {"logprobs": []}
        return [
            self._event(kind, **where, content_index=0, text=block.text, **extra),
            self._event(
                "response.content_part.done", **where, content_index=0, part=_part(block, block.text)
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def end(self, usage: Usage) -> list[str]:
        response = self._response(usage)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [self._event(kind, response=response.model_dump(mode="json"))]

    def error(self, error: ApiError) -> list[str]:
        body = error.body(Dialect.OPENAI)["error"]
        return [self._event("error", code=body["code"], message=body["message"], param=body["param"])]


def _truncated(finish: Finish | None) -> bool:
    """Whether the output was cut by ``max_output_tokens``."""
    return finish is not None and finish.reason is FinishReason.LENGTH


def _item_status(truncated: bool, last: bool) -> str:
    """An output item's final status: the last item of a cut output is ``incomplete``, the items
    that closed before it (and every item of a finished output) ``completed``."""
    return "incomplete" if truncated and last else "completed"


def _part(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Usage) -> p.ResponseUsage:
    return p.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=p.InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=p.OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
        total_tokens=usage.total_tokens,
    )
