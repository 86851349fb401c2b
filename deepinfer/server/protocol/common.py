"""Pieces shared by the OpenAI-style request models."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

StopString = Annotated[str, Field(min_length=1)]
StopStrings = StopString | list[StopString]


def supported_parts(accepted: Iterable[str]) -> BeforeValidator:
    """A validator for a message's ``content`` list: a part whose ``type`` is not one of ``accepted``
    (an image, audio, a file: the model reads text only) is refused with a message that names the
    part, its type and the accepted types, instead of a union mismatch. Other values pass on."""
    names = sorted(accepted)

    def check(value: Any) -> Any:
        refuse_unsupported_parts(value, names)
        return value

    return BeforeValidator(check)


def refuse_unsupported_parts(content: Any, accepted: Iterable[str], where: str = "content") -> None:
    """Raise ValueError if the ``content`` list (at ``where``, for the message) has a part whose
    ``type`` is not in ``accepted``; anything else (text, a malformed value) is left to the model."""
    names = sorted(accepted)
    for i, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in names:
            raise ValueError(
                f"{where} part {i} has type {kind!r}, which is not supported: this model reads text "
                f"only (accepted part types: {', '.join(names)})"
            )


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    traffic_class: str | None = None  # KV store retention class (else the X-DeepInfer-Traffic-Class header)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class OpenAISampling(RequestModel):
    """The sampling fields Chat Completions and Completions share, plus vLLM-compatible extensions
    (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    seed: int | None = None
    stop: StopStrings | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The SamplingParams fields these set (``None``: the default)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int


class OpenAIUsage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None
