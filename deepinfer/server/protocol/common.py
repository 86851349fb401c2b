"""Pieces shared by the OpenAI-style request models."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

StopString = Annotated[str, Field(min_length=1)]
StopStrings = StopString | list[StopString]


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
