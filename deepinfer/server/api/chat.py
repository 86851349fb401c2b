"""``POST /v1/chat/completions``: OpenAI Chat Completions over the DeepSeek chat recipe."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deepinfer.recipe import (
    AssistantMessage,
    BlockDelta,
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
    openai_usage,
    output_schema,
    respond,
    single_call_stop,
)
from deepinfer.server.api.logprobs import chat_logprobs
from deepinfer.server.context import ApiFields, traffic_class
from deepinfer.server.generation import ChatRun, ChoiceUpdate, Finish, FinishReason, Usage
from deepinfer.server.protocol import chat as p
from deepinfer.server.protocol.common import OpenAIUsage
from deepinfer.web.errors import ApiError, Dialect
from deepinfer.web.sse import EventTemplate, sse

router = APIRouter()

CHAT_FIELDS = ChatFields(
    messages="messages",
    tools="tools",
    tool_choice="tool_choice",
    thinking="reasoning_effort",
    tool_parameters="tools[{i}].function.parameters",
)
CONSTRAINT_FIELDS = {"json_schema": "response_format", "grammar": "tool_choice"}
THINKING_EFFORTS = ("low", "medium", "high")


def openai_finish_reason(finish: Finish) -> str:
    return {FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}.get(finish.reason, "stop")


def _text(content: p.Content | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def to_messages(messages: list[p.ChatMessage]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        if isinstance(m, p.SystemMessage):
            out.append(SystemMessage(content=_text(m.content)))
        elif isinstance(m, p.UserMessage):
            out.append(UserMessage(content=_text(m.content)))
        elif isinstance(m, p.ToolMessage):
            out.append(ToolMessage(content=_text(m.content), tool_call_id=m.tool_call_id))
        else:
            calls = tuple(
                ToolCall(name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or ()
            )
            out.append(AssistantMessage(content=_text(m.content), tool_calls=calls))
    return out


def thinking_requested(body: p.ChatCompletionRequest) -> bool:
    kwargs = body.chat_template_kwargs or {}
    return body.reasoning_effort in THINKING_EFFORTS or bool(
        kwargs.get("thinking", kwargs.get("enable_thinking"))
    )


def _refuse_unsupported(body: p.ChatCompletionRequest) -> None:
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def _output_schema(
    body: p.ChatCompletionRequest, thinking: bool, tools: list[ToolSpec]
) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None:
        return None
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    strict = bool(fmt.json_schema is not None and fmt.json_schema.strict)
    return output_schema(
        fmt.type, schema, "response_format", "response_format.json_schema.schema", thinking, tools, strict
    )


@router.post("/v1/chat/completions", response_model=p.ChatCompletion)
async def create_chat_completion(body: p.ChatCompletionRequest, request: Request, ctx: Serving) -> Response:
    """Chat with the model (OpenAI Chat Completions); ``stream: true`` streams chunks as SSE."""
    ctx.check_model(body.model)
    ctx.check_admitting()
    _refuse_unsupported(body)
    choice = (
        body.tool_choice
        if isinstance(body.tool_choice, str | None)
        else f"function:{body.tool_choice.function.name}"
    )
    specs = [
        ToolSpec(
            name=t.function.name,
            description=t.function.description or "",
            parameters=t.function.parameters or {},
        )
        for t in body.tools or ()
    ]
    tools = offered_tools(specs, choice, CHAT_FIELDS)
    use_max = "max_tokens" if body.max_completion_tokens is None and body.max_tokens is not None else None
    fields = ApiFields(
        prompt="messages", max_tokens=use_max or "max_completion_tokens", renamed=CONSTRAINT_FIELDS
    )
    thinking = thinking_requested(body)
    top_logprobs = body.top_logprobs or 0
    params = ctx.sampling_params(
        {
            **body.sampling_values(),
            "max_tokens": body.max_completion_tokens or body.max_tokens,
            "logprobs": top_logprobs if body.logprobs else None,
            "json_schema": _output_schema(body, thinking, tools),
            "grammar": forced_tool_grammar(ctx, tools, choice, thinking, CHAT_FIELDS),
            "stop_token_ids": single_call_stop(ctx, tools, body.parallel_tool_calls),
            "traffic_class": traffic_class(body, request),
        },
        fields,
    )
    prompt = await encode_conversation(ctx, to_messages(body.messages), tools, thinking, CHAT_FIELDS)
    run = ChatRun(ctx, ctx.admit(prompt, params, fields, request.state.arrival_time), prompt, params)
    renderer = ChatRenderer(
        run, ctx.model_name, params.n, top_logprobs if body.logprobs else None, body.include_usage
    )
    return await respond(request, run, renderer, bool(body.stream), fields)


class ChatRenderer:
    """Chat Completions' body and chunks for a :class:`ChatRun`."""

    def __init__(
        self, run: ChatRun, model: str, n: int, top_logprobs: int | None, include_usage: bool
    ) -> None:
        self.run = run
        self.id = new_id("chatcmpl-")
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        # per choice: tool-call block index -> (call index, call id)
        self._tool_calls: list[dict[int, tuple[int, str]]] = [{} for _ in range(n)]
        self._text_chunks: dict[tuple[int, str], EventTemplate] = {}  # (choice, delta field) -> chunk

    def _chunk_data(self, choices: list[p.ChunkChoice], usage: OpenAIUsage | None = None) -> dict[str, Any]:
        chunk = p.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        data = chunk.model_dump(mode="json", exclude_none=True)
        for choice in data["choices"]:  # OpenAI sends these keys in every chunk, null when unset
            choice.setdefault("logprobs", None)
            choice.setdefault("finish_reason", None)
        return data

    def _chunk(self, choices: list[p.ChunkChoice], usage: OpenAIUsage | None = None) -> str:
        return sse(self._chunk_data(choices, usage))

    def _text_chunk(self, index: int, field: str, text: str) -> str:
        """The chunk of choice ``index``'s new ``content`` or ``reasoning_content`` alone (the one a
        stream sends per token): rendered from a template made once per choice and field."""
        template = self._text_chunks.get((index, field))
        if template is None:
            template = self._text_chunks[index, field] = EventTemplate(
                lambda t: self._chunk_data([p.ChunkChoice(index=index, delta=p.Delta(**{field: t}))])
            )
        return template.render(text)

    def _call(self, choice: int, block: int) -> tuple[int, str]:
        calls = self._tool_calls[choice]
        if block not in calls:
            calls[block] = (len(calls), new_id("call_"))
        return calls[block]

    def start(self) -> list[str]:
        role = [p.ChunkChoice(index=i, delta=p.Delta(role="assistant", content="")) for i in range(self.n)]
        return [self._chunk(role)]

    def update(self, update: ChoiceUpdate) -> list[str]:
        deltas: list[p.Delta | tuple[str, str]] = []  # a plain text delta as (field, text)
        for event in update.events:
            kind = self.run.messages[update.index].blocks[event.index].kind
            if isinstance(event, BlockStart) and kind == "tool_call":
                call, call_id = self._call(update.index, event.index)
                function = p.FunctionCallDelta(name=event.name, arguments="")
                deltas.append(
                    p.Delta(
                        tool_calls=[
                            p.ToolCallDelta(index=call, id=call_id, type="function", function=function)
                        ]
                    )
                )
            elif isinstance(event, BlockDelta) and kind == "tool_call":
                call, _ = self._call(update.index, event.index)
                function = p.FunctionCallDelta(arguments=event.text)
                deltas.append(p.Delta(tool_calls=[p.ToolCallDelta(index=call, function=function)]))
            elif isinstance(event, BlockDelta):
                deltas.append(("reasoning_content" if kind == "reasoning" else "content", event.text))
        logprobs = None
        if self.top_logprobs is not None and update.logprobs:
            logprobs = p.ChoiceLogprobs(
                content=chat_logprobs(update.token_ids, update.logprobs, self.top_logprobs)
            )
        if not deltas and (logprobs is not None or update.finish is not None):
            deltas.append(p.Delta())
        chunks = []
        for k, delta in enumerate(deltas):  # the first chunk has the logprobs, the last the finish
            first_logprobs = logprobs if k == 0 else None
            finish = update.finish if k == len(deltas) - 1 else None
            if isinstance(delta, tuple) and first_logprobs is None and finish is None:
                chunks.append(self._text_chunk(update.index, *delta))
                continue
            if isinstance(delta, tuple):
                delta = p.Delta(**{delta[0]: delta[1]})
            reason = openai_finish_reason(finish) if finish is not None else None
            choice = p.ChunkChoice(
                index=update.index, delta=delta, logprobs=first_logprobs, finish_reason=reason
            )
            chunks.append(self._chunk([choice]))
        return chunks

    def end(self, usage: Usage) -> list[str]:
        events = [self._chunk([], openai_usage(usage))] if self.include_usage else []
        return [*events, sse("[DONE]")]

    def error(self, error: ApiError) -> list[str]:
        return [sse(error.body(Dialect.OPENAI)), sse("[DONE]")]

    def response(self) -> dict[str, Any]:
        final = self.run.final
        choices = []
        for i, message in enumerate(self.run.messages):
            calls = [
                p.ToolCallOut(
                    id=self._call(i, b)[1],
                    function=p.FunctionCallOut(name=block.name or "", arguments=block.text.strip()),
                )
                for b, block in enumerate(message.blocks)
                if block.kind == "tool_call"
            ]
            logprobs = None
            if self.top_logprobs is not None and final is not None:
                completion = final.outputs[i]
                content = chat_logprobs(completion.token_ids, completion.logprobs or [], self.top_logprobs)
                logprobs = p.ChoiceLogprobs(content=content)
            choices.append(
                p.Choice(
                    index=i,
                    message=p.ResponseMessage(
                        content=message.content if message.content or not calls else None,
                        reasoning_content=message.reasoning,
                        tool_calls=calls or None,
                    ),
                    logprobs=logprobs,
                    finish_reason=openai_finish_reason(self.run.finishes[i]),
                )
            )
        body = p.ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=openai_usage(self.run.usage),
        )
        data = body.model_dump(mode="json", exclude_none=True)
        for choice in data["choices"]:  # OpenAI's shape: these keys are always there, null when unset
            choice.setdefault("logprobs", None)
            choice["message"].setdefault("content", None)
            choice["message"].setdefault("refusal", None)
        return data
