"""OpenAI Completions (``POST /v1/completions``): raw prompts in, text out.

The prompt is a string, a list of strings, a list of token ids, or a list of token-id lists. Prompt
text is encoded as plain text, as the chat APIs encode message text: the characters of a control
token (``<｜User｜>``, ``<｜end▁of▁sentence｜>`` ...) become ordinary text tokens, and only the BOS
the model expects is added. A request that means control tokens sends them as token ids, or sets the
extension field ``parse_special_tokens: true`` (vLLM's analogous knob is ``add_special_tokens``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool

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
    parse_special_tokens: StrictBool = Field(
        False,
        description=(
            "deepinfer extension: true encodes control-token text in the prompt (such as "
            "<｜User｜>) as the control tokens; false (default) encodes it as plain text"
        ),
    )


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
