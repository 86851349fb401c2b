"""What every route needs: the engine, the model's name, tokenizer, chat recipe and limits, and the
checks that turn a request into an admitted engine request (or a 4xx naming the field at fault)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from deepinfer.recipe import ChatRecipe
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.async_engine import AsyncEngine, EngineDead, QueueFull, RequestStream
from deepinfer.server.errors import ApiError, field_path
from deepinfer.server.metrics import ServerMetrics
from deepinfer.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ApiFields:
    """What the caller's API calls the prompt and the token limit (for error messages), and how
    its sampling fields map onto ``SamplingParams`` (``{"stop": "stop_sequences"}``)."""

    prompt: str
    max_tokens: str
    renamed: Mapping[str, str] = field(default_factory=dict)  # SamplingParams field -> API field

    def api_name(self, name: str) -> str:
        return self.max_tokens if name == "max_tokens" else self.renamed.get(name, name)


def traffic_class(body: Any, request: Any) -> str | None:
    """The KV store traffic class: the body's ``traffic_class``, else the X-DeepInfer-Traffic-Class header."""
    return body.traffic_class or request.headers.get("x-deepinfer-traffic-class")


class ServingContext:
    """What every route needs: the engine, the tokenizer and chat recipe, the model's name and limits."""

    def __init__(
        self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, retry_after_s: int
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        self.tokenizer: Tokenizer | None = engine.engine.tokenizer
        self.recipe: ChatRecipe | None = None
        self.recipe_error = "the model folder has no tokenizer.json"
        if self.tokenizer is not None:
            try:
                self.recipe = ChatRecipe(self.tokenizer)
            except ValueError as exc:
                self.recipe_error = str(exc)

    def check_model(self, name: str | None) -> None:
        if name != self.model_name:
            raise ApiError(
                404, f"model {name!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def chat_recipe(self) -> ChatRecipe:
        if self.recipe is None:
            raise ApiError(400, f"this model has no chat format ({self.recipe_error}); use /v1/completions")
        return self.recipe

    @staticmethod
    def sampling_params(values: Mapping[str, Any], fields: ApiFields) -> SamplingParams:
        """``SamplingParams`` from the request's values (``None``: the default; ``max_tokens=None``:
        up to the context length). Invalid values are a 400 naming the API's field."""
        given = {k: v for k, v in values.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**given)
        except ValidationError as exc:
            first = exc.errors()[0]
            name = fields.api_name(str(first["loc"][0])) if first["loc"] else None
            path = field_path([name, *first["loc"][1:]]) if name else None
            raise ApiError(400, f"{path}: {first['msg']}" if path else first["msg"], param=path) from None

    def admit(self, prompt_token_ids: list[int], params: SamplingParams, fields: ApiFields) -> RequestStream:
        """Check the request against the context length, then hand it to the engine (429 when the
        queue is full, 503 when the engine is down)."""
        length, limit = len(prompt_token_ids), self.max_model_len
        if not prompt_token_ids:
            raise ApiError(400, "the prompt is empty", param=fields.prompt)
        if length >= limit:
            raise ApiError(
                400,
                f"the prompt has {length} tokens; the context length is {limit}, so at most {limit - 1} "
                "prompt tokens fit",
                param=fields.prompt,
            )
        if params.max_tokens is not None and params.max_tokens > limit - length:
            raise ApiError(
                400,
                f"{fields.max_tokens}={params.max_tokens} plus the prompt's {length} tokens exceeds the context "
                f"length {limit}; at most {limit - length} new tokens fit",
                param=fields.max_tokens,
            )
        try:
            return self.engine.submit(prompt_token_ids, params)
        except QueueFull as exc:
            self.metrics.rejected.inc()
            raise ApiError(
                429,
                f"the server is at capacity ({exc}); retry later",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except EngineDead as exc:
            raise ApiError(503, str(exc)) from None
