"""What every route needs: the engine client, the model's name, tokenizer, chat recipe and limits,
and the checks that turn a request into an admitted engine request (or a 4xx naming the field)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from deepinfer.core.client import EngineClient, EngineDead, QueueFull, RequestStream
from deepinfer.recipe import ChatRecipe
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.config import ServerConfig
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.validation import max_token_chars
from deepinfer.tokenizer import Tokenizer
from deepinfer.web.errors import ApiError, field_path


@dataclass(frozen=True, slots=True)
class ApiFields:
    """What the caller's API calls the prompt and the token limit (for error messages), and how
    its sampling fields map onto ``SamplingParams`` (``{"stop": "stop_sequences"}``, and the output
    constraint: ``{"json_schema": "response_format"}``)."""

    prompt: str
    max_tokens: str
    renamed: Mapping[str, str] = field(default_factory=dict)  # SamplingParams field -> API field

    def api_name(self, name: str) -> str:
        return self.max_tokens if name == "max_tokens" else self.renamed.get(name, name)


def traffic_class(body: Any, request: Any) -> str | None:
    """The KV store traffic class: the body's ``traffic_class``, else the X-DeepInfer-Traffic-Class header."""
    return body.traffic_class or request.headers.get("x-deepinfer-traffic-class")


class ServingContext:
    """What every route needs (see the module docstring). ``draining``: the server is shutting
    down; new requests get 503 with Retry-After."""

    def __init__(
        self, client: EngineClient, config: ServerConfig, metrics: ServerMetrics, tokenizer: Tokenizer | None
    ) -> None:
        self.client = client
        self.config = config
        self.model_name = config.served_model_name
        self.metrics = metrics
        self.retry_after_s = config.retry_after_s
        self.draining = False
        # Wraps each admitted stream (set by deepinfer.server.kv_transfer.install: a P/D handoff watches it)
        self.stream_observer: Callable[[list[int], SamplingParams, RequestStream], RequestStream] | None = (
            None
        )
        self.tokenizer = tokenizer
        self.recipe: ChatRecipe | None = None
        self.recipe_error = "the model folder has no tokenizer.json"
        self._token_chars = max_token_chars(list(tokenizer.backend.get_vocab())) if tokenizer else 1
        if tokenizer is not None:
            try:
                self.recipe = ChatRecipe(tokenizer)
            except ValueError as exc:
                self.recipe_error = str(exc)

    @property
    def max_model_len(self) -> int:
        info = self.client.info
        if info is None:
            raise ApiError(503, "the engine core is not ready yet", headers=self._retry())
        return info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size if self.client.info else 0

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def check_model(self, name: str | None) -> None:
        if name != self.model_name:
            raise ApiError(
                404, f"model {name!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def check_admitting(self) -> None:
        """503 with Retry-After while the server drains (it stops taking requests)."""
        if self.draining:
            raise ApiError(
                503, "the server is shutting down; retry on another replica or later", headers=self._retry()
            )

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text with more characters than the context could hold even
        if every token were the longest one in the vocabulary."""
        limit = self.max_model_len * self._token_chars
        if chars > limit:
            raise ApiError(
                400,
                f"{param}: the text has {chars} characters; the context length is {self.max_model_len} tokens, "
                f"which hold at most {limit} characters",
                param=param,
            )

    def chat_recipe(self) -> ChatRecipe:
        if self.recipe is None:
            raise ApiError(400, f"this model has no chat format ({self.recipe_error}); use /v1/completions")
        return self.recipe

    @staticmethod
    def sampling_params(values: Mapping[str, Any], fields: ApiFields) -> SamplingParams:
        """``SamplingParams`` from the request's values (``None``: the default; ``max_tokens=None``:
        the server's default, resolved at admission). Invalid values are a 400 naming the API's field."""
        given = {k: v for k, v in values.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**given)
        except ValidationError as exc:
            first = exc.errors()[0]
            name = fields.api_name(str(first["loc"][0])) if first["loc"] else None
            path = field_path([name, *first["loc"][1:]]) if name else None
            raise ApiError(400, f"{path}: {first['msg']}" if path else first["msg"], param=path) from None

    def admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        fields: ApiFields,
        arrival_time: float,
        detokenize: bool = False,
    ) -> RequestStream:
        """Check the request against the context length and the token limits (filling in the
        default ``max_tokens``), then hand it to the engine (429 when the queue is full, 503 when
        the engine is down or the server drains)."""
        self.check_admitting()
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
        room = limit - length
        cap = self.config.max_tokens_limit
        if params.max_tokens is None:
            default = self.config.max_tokens_default
            params = params.model_copy(update={"max_tokens": min(room, default or room, cap or room)})
        elif cap is not None and params.max_tokens > cap:
            raise ApiError(
                400,
                f"{fields.max_tokens}={params.max_tokens} exceeds this server's limit of {cap} new tokens",
                param=fields.max_tokens,
            )
        elif params.max_tokens > room:
            raise ApiError(
                400,
                f"{fields.max_tokens}={params.max_tokens} plus the prompt's {length} tokens exceeds the context "
                f"length {limit}; at most {room} new tokens fit",
                param=fields.max_tokens,
            )
        try:
            stream = self.client.submit(prompt_token_ids, params, arrival_time, detokenize)
        except QueueFull as exc:
            self.metrics.rejected.inc()
            raise ApiError(
                429, f"the server is at capacity ({exc}); retry later", headers=self._retry()
            ) from None
        except EngineDead as exc:
            raise ApiError(503, str(exc), headers=self._retry()) from None
        if self.stream_observer is None:
            return stream
        return self.stream_observer(prompt_token_ids, params, stream)
