"""What the API modules share: encoding a conversation, tool and thinking options, and answering
with a JSON body or an event stream through a :class:`Renderer`.

Each API is an adapter (its request -> recipe messages, tools, ``SamplingParams``) plus a renderer
(:class:`~deepinfer.server.generation.ChoiceUpdate` s -> its own JSON and SSE events); the engine
request, parsing, usage, disconnect handling and error mapping happen here and in ``generation``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.core.client import EngineDead, RequestRefused, RequestTimedOut
from deepinfer.logger import get_logger
from deepinfer.recipe import Message, ToolSpec
from deepinfer.recipe import tokens as T
from deepinfer.server.context import ApiFields, ServingContext
from deepinfer.server.generation import ChoiceUpdate, Updates, Usage
from deepinfer.server.protocol.common import CompletionTokensDetails, OpenAIUsage, PromptTokensDetails
from deepinfer.server.validation import json_schema_error
from deepinfer.structured.closing import closed
from deepinfer.structured.tool_calls import tool_call_grammar
from deepinfer.web.errors import ApiError
from deepinfer.web.sse import EventStreamResponse

TOOL_CALL_MARKERS = {
    "tool_calls_begin": T.TOOL_CALLS_BEGIN,
    "tool_call_begin": T.TOOL_CALL_BEGIN,
    "tool_sep": T.TOOL_SEP,
    "tool_call_end": T.TOOL_CALL_END,
    "tool_calls_end": T.TOOL_CALLS_END,
}

logger = get_logger(__name__)


async def serving_context(request: Request) -> ServingContext:
    """FastAPI dependency: the context of the app serving this request (``async``, so FastAPI
    runs it on the event loop, not in its thread pool)."""
    return request.app.state.serving


Serving = Annotated[ServingContext, Depends(serving_context)]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def openai_usage(usage: Usage) -> OpenAIUsage:
    """Usage in OpenAI's Chat Completions / Completions shape."""
    return OpenAIUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )


@dataclass(frozen=True, slots=True)
class ChatFields:
    """Names of a chat API's fields, for error messages (``tool_parameters``: the path of tool
    ``i``'s parameters schema, with ``{i}`` for the index)."""

    messages: str
    tools: str
    tool_choice: str
    thinking: str
    tool_parameters: str


def offered_tools(tools: list[ToolSpec], choice: str | None, fields: ChatFields) -> list[ToolSpec]:
    """The tools to describe in the prompt under ``tool_choice``: none for ``none``, all of them
    otherwise (a named tool must be one of them)."""
    if choice == "none":
        return []
    if choice is not None and choice.startswith("function:"):
        name = choice.removeprefix("function:")
        if name not in {t.name for t in tools}:
            raise ApiError(
                400,
                f"{fields.tool_choice} names {name!r}, which is not in {fields.tools}",
                param=fields.tool_choice,
            )
    elif choice not in (None, "auto", "required"):
        raise ApiError(400, f"{fields.tool_choice}={choice!r} is not supported", param=fields.tool_choice)
    return tools


def forced_tool_grammar(
    ctx: ServingContext, tools: list[ToolSpec], choice: str | None, thinking: bool, fields: ChatFields
) -> str | None:
    """For ``tool_choice`` "required" or a named tool: a grammar that makes the answer one call in
    DeepSeek's tool-call format, its arguments constrained by the tool's parameters schema."""
    if choice != "required" and not (choice or "").startswith("function:"):
        return None
    if not tools:
        raise ApiError(400, f"{fields.tool_choice}={choice!r} needs {fields.tools}", param=fields.tool_choice)
    if thinking:
        raise ApiError(
            400,
            f"{fields.tool_choice}={choice!r} needs non-thinking mode (the call starts at the first token)",
            param=fields.tool_choice,
        )
    indexed = list(enumerate(tools))
    if choice.startswith("function:"):
        indexed = [(i, t) for i, t in indexed if t.name == choice.removeprefix("function:")]
    for i, tool in indexed:
        problem = json_schema_error(closed(dict(tool.parameters) or {"type": "object"}))
        if problem is not None:
            param = fields.tool_parameters.format(i=i)
            raise ApiError(
                400, f"{param}: the tool's parameters schema cannot be enforced: {problem}", param=param
            )
    tools = [t for _, t in indexed]
    tokenizer = ctx.chat_recipe().tokenizer
    ids = {name: tokenizer.token_to_id(marker) for name, marker in TOOL_CALL_MARKERS.items()}
    try:
        return tool_call_grammar(
            [(t.name, t.parameters) for t in tools], {k: v for k, v in ids.items() if v is not None}
        )
    except ValueError as exc:
        raise ApiError(400, f"{fields.tool_choice}: {exc}", param=fields.tool_choice) from None


def single_call_stop(ctx: ServingContext, tools: list[ToolSpec], parallel: bool | None) -> list[int] | None:
    """Stop tokens that limit an answer to one tool call when the request turns parallel calls off
    (``parallel_tool_calls: false``, Anthropic's ``disable_parallel_tool_use``): generation ends on
    the first call's closing token, so the answer has at most one call (finish reason
    ``tool_calls``) and no tokens are spent on the calls it would have added. ``None`` otherwise.
    (A forced call, ``tool_choice`` required or named, is one call by its grammar either way.)"""
    if parallel is not False or not tools:
        return None
    end = ctx.chat_recipe().tokenizer.token_to_id(T.TOOL_CALL_END)
    return [end] if end is not None else None


def output_schema(
    kind: str,
    schema: dict[str, Any] | None,
    param: str,
    schema_param: str,
    thinking: bool,
    tools: list[ToolSpec],
    strict: bool = False,
) -> dict[str, Any] | None:
    """The JSON schema a response format (field ``param``; its schema at ``schema_param``)
    constrains the answer to (``None``: free text). The constraint holds from the first generated
    token, so it excludes thinking and tool calls; a schema the grammar backend cannot compile is a
    400 naming ``schema_param``. With ``strict`` (the format's ``strict: true``) objects are closed
    (:func:`~deepinfer.structured.closing.closed`: no keys beyond ``properties`` unless the schema
    allows more); without it the schema keeps JSON Schema's reading, where objects are open."""
    if kind == "text":
        return None
    if thinking:
        raise ApiError(
            400,
            f"{param}={kind!r} needs non-thinking mode (the constraint starts at the first token)",
            param=param,
        )
    if tools:
        raise ApiError(
            400,
            f"{param}={kind!r} cannot be combined with tools (a JSON answer has no tool calls)",
            param=param,
        )
    if kind == "json_object":
        return {"type": "object"}
    if schema is None:
        raise ApiError(400, f"{param}: a json_schema format needs its schema", param=param)
    if strict:
        schema = closed(schema)
    problem = json_schema_error(schema)
    if problem is not None:
        raise ApiError(400, f"{schema_param}: the schema cannot be enforced: {problem}", param=schema_param)
    return schema


async def encode_conversation(
    ctx: ServingContext,
    messages: Sequence[Message],
    tools: list[ToolSpec],
    thinking: bool,
    fields: ChatFields,
) -> list[int]:
    """Prompt token ids of a conversation (encoded off the event loop)."""
    recipe = ctx.chat_recipe()
    if thinking and not recipe.supports_thinking:
        raise ApiError(400, f"{fields.thinking}: this model has no thinking mode", param=fields.thinking)
    if tools and not recipe.supports_tools:
        raise ApiError(400, f"{fields.tools}: this model has no tool-call tokens", param=fields.tools)
    ctx.check_text_length(conversation_chars(messages, tools), fields.messages)
    try:
        return await asyncio.to_thread(recipe.encode_chat, messages, tools, thinking)
    except ValueError as exc:
        raise ApiError(400, f"{fields.messages}: {exc}", param=fields.messages) from None


def conversation_chars(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> int:
    """Characters of text a conversation carries (contents, tool-call arguments, tool specs)."""
    chars = 0
    for message in messages:
        chars += len(message.content or "")
        chars += sum(len(c.name) + len(c.arguments) for c in getattr(message, "tool_calls", ()))
    return chars + sum(len(t.name) + len(t.description) + len(str(t.parameters)) for t in tools)


class Renderer(Protocol):
    """Turns a run into one API's response: a JSON body, or SSE events (each method returns the
    encoded events to send)."""

    def start(self) -> list[str]: ...

    def update(self, update: ChoiceUpdate) -> list[str]: ...

    def end(self, usage: Usage) -> list[str]: ...

    def error(self, error: ApiError) -> list[str]: ...

    def response(self) -> dict[str, Any]: ...


def as_api_error(exc: Exception, fields: ApiFields | None = None) -> ApiError:
    """The error a caller sees for a failure while its request ran (``fields``: to name the API
    field of a refused ``SamplingParams`` field)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineDead):
        return ApiError(503, str(exc))
    if isinstance(exc, RequestTimedOut):
        return ApiError(504, str(exc))
    if isinstance(exc, RequestRefused) and exc.field is not None and fields is not None:
        param = fields.api_name(exc.field)
        return ApiError(400, f"{param}: {exc}", param=param)
    if isinstance(exc, ValueError):  # the engine refused the request
        return ApiError(400, str(exc))
    logger.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}")


async def respond(
    request: Request, run: Updates, renderer: Renderer, stream: bool, fields: ApiFields
) -> Response:
    """Answer with the finished response, or stream it as it is generated."""
    if stream:
        try:
            await run.accepted()  # a request the engine refuses still gets its 4xx status, not a 200
        except Exception as exc:
            run.close()
            raise as_api_error(exc, fields) from None
        except BaseException:
            run.close()
            raise
        return EventStreamResponse(_events(run, renderer), on_close=run.close)
    try:
        await run.collect(request)
    except Exception as exc:
        raise as_api_error(exc, fields) from None
    return JSONResponse(renderer.response())


async def _events(run: Updates, renderer: Renderer) -> AsyncGenerator[str, None]:
    try:
        if head := "".join(renderer.start()):
            yield head
        async with aclosing(run.updates()) as updates:
            async for step in updates:
                events = [e for update in step for e in renderer.update(update)]
                if events:
                    yield "".join(events)
        yield "".join(renderer.end(run.usage))
    except Exception as exc:
        yield "".join(renderer.error(as_api_error(exc)))
