"""``POST /v1/completions``: OpenAI (legacy) Completions: raw prompts, plain text out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deepinfer.recipe import BlockDelta
from deepinfer.recipe.tokens import plain_text_encoder
from deepinfer.server.api.common import Serving, new_id, openai_usage, respond
from deepinfer.server.api.logprobs import completion_logprobs
from deepinfer.server.context import ApiFields, ServingContext, traffic_class
from deepinfer.server.generation import ChoiceUpdate, FinishReason, RunGroup, TextRun, Usage, total_usage
from deepinfer.server.protocol import completions as p
from deepinfer.tokenizer import Tokenizer
from deepinfer.web.errors import ApiError, Dialect
from deepinfer.web.sse import EventTemplate, sse

router = APIRouter()

FIELDS = ApiFields(prompt="prompt", max_tokens="max_tokens")


def _refuse_unsupported(body: p.CompletionRequest) -> None:
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise ApiError(400, "best_of must equal n (candidates are not ranked)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo together with logprobs is not supported", param="echo")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")


def _encode_texts(tokenizer: Tokenizer, texts: list[str], parse_special_tokens: bool) -> list[list[int]]:
    """Token ids of raw prompts, in one parallel batch, with the BOS the tokenizer's config asks for.
    Control-token text is encoded as plain text unless ``parse_special_tokens``."""
    if parse_special_tokens:
        ids = [e.ids for e in tokenizer.backend.encode_batch(texts)]
    else:
        try:
            ids = plain_text_encoder(tokenizer).encode_batch(texts)
        except ValueError as exc:
            raise ApiError(
                400,
                f"this tokenizer cannot encode control-token text as plain text ({exc}); send the prompt "
                "as token ids, or set parse_special_tokens: true",
                param="parse_special_tokens",
            ) from None
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    return [[bos, *i] if bos is not None and (not i or i[0] != bos) else i for i in ids]


async def tokenize_prompts(
    ctx: ServingContext, prompt: p.Prompt, parse_special_tokens: bool = False
) -> list[list[int]]:
    """The prompt(s) as token-id lists (token ids are checked against the vocabulary; text is encoded
    as plain text unless ``parse_special_tokens``)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if all(isinstance(t, str) for t in prompt):
        if ctx.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        for i, text in enumerate(prompt):
            ctx.check_text_length(len(text), f"prompt[{i}]" if len(prompt) > 1 else "prompt")
        return await asyncio.to_thread(_encode_texts, ctx.tokenizer, list(prompt), parse_special_tokens)
    vocab_size = ctx.vocab_size
    for i, ids in enumerate(prompt):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ApiError(
                400,
                f"prompt[{i}]: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )
    return [list(ids) for ids in prompt]


@router.post("/v1/completions", response_model=p.Completion)
async def create_completion(body: p.CompletionRequest, request: Request, ctx: Serving) -> Response:
    """Complete raw prompts (OpenAI Completions); ``stream: true`` streams chunks as SSE."""
    ctx.check_model(body.model)
    ctx.check_admitting()
    _refuse_unsupported(body)
    params = ctx.sampling_params(
        {
            **body.sampling_values(),
            "max_tokens": body.max_tokens,
            "logprobs": body.logprobs,
            "traffic_class": traffic_class(body, request),
        },
        FIELDS,
    )
    prompts = await tokenize_prompts(ctx, body.prompt, body.parse_special_tokens)
    runs: list[TextRun] = []
    try:
        for ids in prompts:
            stream = ctx.admit(ids, params, FIELDS, request.state.arrival_time, detokenize=True)
            runs.append(TextRun(ctx, stream, ids, params))
    except ApiError:
        for run in runs:
            run.close()
        raise
    echo = _echo_texts(ctx, body.prompt, prompts) if body.echo else None
    renderer = CompletionRenderer(runs, ctx.model_name, params.n, body.logprobs, echo, body.include_usage)
    group = runs[0] if len(runs) == 1 else RunGroup(runs, params.n)
    return await respond(request, group, renderer, bool(body.stream), FIELDS)


def _echo_texts(ctx: ServingContext, prompt: p.Prompt, prompts: list[list[int]]) -> list[str]:
    """What ``echo`` puts before each completion: a text prompt exactly as sent, token-id prompts
    decoded (without special tokens)."""
    texts = [prompt] if isinstance(prompt, str) else prompt
    if all(isinstance(t, str) for t in texts):
        return list(texts)
    return [ctx.tokenizer.decode(ids) if ctx.tokenizer else "" for ids in prompts]


class CompletionRenderer:
    """Completions' body and chunks for one or more :class:`TextRun` s (choice ``i * n + j`` is
    completion ``j`` of prompt ``i``)."""

    def __init__(
        self,
        runs: list[TextRun],
        model: str,
        n: int,
        logprobs: int | None,
        echo: list[str] | None,
        include_usage: bool,
    ) -> None:
        self.runs = runs
        self.id = new_id("cmpl-")
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.logprobs = logprobs
        self.echo = echo
        self.include_usage = include_usage
        self._offsets = [len(echo[i // n]) if echo else 0 for i in range(len(runs) * n)]
        self._text_chunks: dict[int, EventTemplate] = {}  # choice index -> its plain text chunk

    def _chunk_data(self, choices: list[p.CompletionChoice], usage: Usage | None = None) -> dict[str, Any]:
        body = p.Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=openai_usage(usage) if usage is not None else None,
        )
        return body.model_dump(mode="json", exclude_none=True)

    def _chunk(self, choices: list[p.CompletionChoice], usage: Usage | None = None) -> str:
        return sse(self._chunk_data(choices, usage))

    def _text_chunk(self, index: int, text: str) -> str:
        """The chunk of choice ``index``'s new text (no log-probabilities, not finished), the one a
        stream sends per token: rendered from a template made once per choice."""
        template = self._text_chunks.get(index)
        if template is None:
            template = self._text_chunks[index] = EventTemplate(
                lambda t: self._chunk_data([p.CompletionChoice(index=index, text=t, finish_reason=None)])
            )
        return template.render(text)

    @staticmethod
    def _finish_reason(reason: FinishReason) -> str:
        return "length" if reason is FinishReason.LENGTH else "stop"

    def start(self) -> list[str]:
        if not self.echo:
            return []
        choices = [
            p.CompletionChoice(index=i, text=self.echo[i // self.n], finish_reason=None)
            for i in range(len(self.runs) * self.n)
        ]
        return [self._chunk(choices)]

    def update(self, update: ChoiceUpdate) -> list[str]:
        text = "".join(e.text for e in update.events if isinstance(e, BlockDelta))
        logprobs = None
        if self.logprobs is not None and update.logprobs:
            logprobs = completion_logprobs(
                update.token_ids, update.logprobs, self.logprobs, self._offsets[update.index]
            )
        self._offsets[update.index] += len(text)
        if logprobs is None and update.finish is None:
            return [self._text_chunk(update.index, text)] if text else []
        reason = self._finish_reason(update.finish.reason) if update.finish else None
        choice = p.CompletionChoice(index=update.index, text=text, logprobs=logprobs, finish_reason=reason)
        return [self._chunk([choice])]

    def end(self, usage: Usage) -> list[str]:
        events = [self._chunk([], usage)] if self.include_usage else []
        return [*events, sse("[DONE]")]

    def error(self, error: ApiError) -> list[str]:
        return [sse(error.body(Dialect.OPENAI)), sse("[DONE]")]

    def response(self) -> dict[str, Any]:
        choices = []
        for r, run in enumerate(self.runs):
            prefix = self.echo[r] if self.echo else ""
            for j, text in enumerate(run.texts):
                logprobs = None
                if self.logprobs is not None and run.final is not None:
                    completion = run.final.outputs[j]
                    logprobs = completion_logprobs(
                        completion.token_ids, completion.logprobs or [], self.logprobs, 0
                    )
                choices.append(
                    p.CompletionChoice(
                        index=r * self.n + j,
                        text=prefix + text,
                        logprobs=logprobs,
                        finish_reason=self._finish_reason(run.finishes[j].reason),
                    )
                )
        usage = total_usage(self.runs)
        body = p.Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=openai_usage(usage)
        )
        return body.model_dump(mode="json", exclude_none=True)
