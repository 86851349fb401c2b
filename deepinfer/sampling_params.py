"""Per-request sampling and stopping parameters (validated at construction)."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepinfer.text_input import require_valid_text


class SamplingParams(BaseModel):
    """How to sample a request's tokens and when to stop.

    Invalid values raise ``ValueError`` (pydantic's ValidationError) naming the field and the
    accepted range. ``temperature=0`` is greedy. ``top_k`` 0 or -1 disables top-k. ``logprobs=k``
    returns, per generated token, the sampled token's log-probability plus the k most likely ones
    (``0``: the sampled token only); ``prompt_logprobs`` likewise for prompt tokens. Log-probabilities
    are those of the model's raw distribution (before penalties and temperature).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = Field(1, ge=1, le=128, description="number of completions per prompt")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: disabled")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    max_tokens: int | None = Field(16, ge=1, description="None: up to the model's context length")
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    skip_special_tokens: bool = True
    # Structured outputs (at most one): the output must match the regex / the JSON schema / the Lark
    # (or GBNF) grammar / be one of the choices.
    regex: str | None = None
    json_schema: dict | str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    # KV store retention class (agent, chat or one the operator configures); None: the default.
    traffic_class: str | None = Field(None, min_length=1, max_length=16)

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        given = [n for n in ("regex", "json_schema", "grammar", "choice") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of regex, json_schema, grammar, choice; got {', '.join(given)}"
            )
        return self

    @model_validator(mode="after")
    def _valid_text(self) -> SamplingParams:
        """Every text field must be valid Unicode (no lone surrogates): it reaches the tokenizer, the
        grammar compiler or a UTF-8 encoder."""
        for name in ("stop", "choice"):
            for i, text in enumerate(getattr(self, name) or ()):
                require_valid_text(text, f"{name}[{i}]")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                require_valid_text(getattr(self, name), name)
        if self.json_schema is not None:
            schema = self.json_schema
            # ensure_ascii=False keeps lone surrogates as characters, so the check finds them.
            require_valid_text(
                schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False), "json_schema"
            )
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: object) -> object:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_reason(self, token: int, eos_token_ids: frozenset[int], num_output_tokens: int) -> str | None:
        """Whether emitting ``token`` as output token number ``num_output_tokens`` (counting it) ends the
        request on a token: "eos" (an EOS id, unless ignore_eos), "stop_token" (one of stop_token_ids),
        or None; neither before min_tokens. The one statement of these rules: the scheduler applies
        them, and the runner checks them to end a multi-iteration decode step early."""
        if num_output_tokens < self.min_tokens:
            return None
        if token in eos_token_ids and not self.ignore_eos:
            return "eos"
        return "stop_token" if token in self.stop_token_ids else None

    @property
    def constrained(self) -> bool:
        """Structured output: the tokens must follow a regex, JSON schema, grammar or choice."""
        return any(v is not None for v in (self.regex, self.json_schema, self.grammar, self.choice))

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
