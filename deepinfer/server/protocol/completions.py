"""OpenAI Completions (``POST /v1/completions``): raw prompts in, text out.

The prompt is a string, a list of strings, a list of token ids, or a list of token-id lists. It is
tokenized as written: control tokens in a raw prompt are meant (unlike chat message text).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from deepinfer.server.protocol.common import OpenAISampling, OpenAIUsage, ResponseModel

TokenId = Annotated[int, Field(ge=0)]
Prompt = (
    str
    | list[TokenId]
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[list[TokenId]], Field(min_length=1)]
)


class CompletionRequest(OpenAISampling):
    model: str
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, description="null: up to the context length")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage | None = None
