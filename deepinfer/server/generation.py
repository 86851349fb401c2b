"""Generation as every API sees it: an admitted engine request read as per-choice updates and usage.

An API module turns its request into prompt token ids and ``SamplingParams``, admits it (see
:mod:`deepinfer.server.context`), and reads a :class:`Run`: ``updates()`` yields, per engine step, a
:class:`ChoiceUpdate` for each choice that progressed (block events, new tokens, log-probabilities,
and the :class:`Finish` once it ended); ``usage`` sums it up. :class:`ChatRun` parses DeepSeek's
chat format (reasoning, answer, tool calls); :class:`TextRun` streams plain text; :class:`RunGroup`
merges several runs (a completions request with several prompts). Only rendering differs between
the APIs.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from starlette.requests import Request

from deepinfer.core.client import RequestStream
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.recipe import BlockDelta, ChatEvent, ParsedMessage, StopStringBuffer
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.context import ServingContext
from deepinfer.server.metrics import RequestMeter
from deepinfer.web.errors import ApiError


class FinishReason(enum.Enum):
    STOP = "stop"  # end of sequence or a stop token
    STOP_STRING = "stop_string"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    stop_string: str | None = None

    @classmethod
    def of(cls, completion: CompletionOutput, called_tools: bool = False) -> Finish:
        if completion.finish_reason == "length":
            return cls(FinishReason.LENGTH)
        if completion.finish_reason == "abort":
            return cls(FinishReason.ABORT)
        if isinstance(completion.stop_reason, str):
            return cls(FinishReason.STOP_STRING, completion.stop_reason)
        return cls(FinishReason.TOOL_CALLS if called_tools else FinishReason.STOP)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class ChoiceUpdate:
    """What one choice did in one engine step."""

    index: int
    events: list[ChatEvent]
    token_ids: list[int]  # tokens generated in this step
    logprobs: list[dict[int, Logprob]] | None  # one entry per token, when requested
    finish: Finish | None = None


class Updates(abc.ABC):
    """A source of per-step choice updates: one engine request (:class:`Run`) or several
    (:class:`RunGroup`)."""

    @abc.abstractmethod
    def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Per engine step, the updates of the choices that progressed. Closing the iterator early
        aborts the request(s)."""

    @abc.abstractmethod
    async def accepted(self) -> None:
        """Wait until the engine has taken the request(s); raises a refusal (``ValueError``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the request(s): abort whatever has not finished. Idempotent."""

    @property
    @abc.abstractmethod
    def usage(self) -> Usage: ...

    async def collect(self, request: Request | None = None) -> None:
        """Run to the end. With ``request``: abort if the client disconnects first (a 499 error)."""

        async def consume() -> None:
            async with aclosing(self.updates()) as updates:
                async for _ in updates:
                    pass

        try:
            if request is None:
                await consume()
                return
            work, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (work, gone):
                    task.cancel()
                await asyncio.gather(work, gone, return_exceptions=True)
            if work.cancelled():
                raise ApiError(499, "the client disconnected")
            if work.exception() is not None:
                raise work.exception()
        finally:
            self.close()  # also when cancelled before the first update


class Run(Updates):
    """One admitted engine request, read as per-choice updates. Subclasses turn each choice's new
    tokens into events (``_advance``, ``_end``) and say how it finished (``_finish``)."""

    def __init__(
        self, ctx: ServingContext, stream: RequestStream, prompt_token_ids: list[int], n: int
    ) -> None:
        self.stream = stream
        self.prompt_tokens = len(prompt_token_ids)
        self.final: RequestOutput | None = None
        self.finishes: list[Finish | None] = [None] * n
        self._meter: RequestMeter = ctx.metrics.meter()
        self._seen = [0] * n

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        try:
            async for output in self.stream:
                self._meter.observe(output)
                updates = []
                for completion in output.outputs:
                    i = completion.index
                    if self.finishes[i] is not None:
                        continue  # ended in an earlier step; the output still lists it
                    new = completion.token_ids[self._seen[i] :]
                    logprobs = (
                        completion.logprobs[self._seen[i] :] if completion.logprobs is not None else None
                    )
                    self._seen[i] = len(completion.token_ids)
                    events = self._advance(i, new, completion)
                    if completion.finished:
                        events += self._end(i, completion)
                        self.finishes[i] = self._finish(i, completion)
                        updates.append(ChoiceUpdate(i, events, new, logprobs, self.finishes[i]))
                    elif events or new:
                        updates.append(ChoiceUpdate(i, events, new, logprobs))
                self.final = output
                yield updates
        finally:
            self.close()

    async def accepted(self) -> None:
        await self.stream.accepted()

    def close(self) -> None:
        self.stream.close()
        self._meter.close()

    @property
    def usage(self) -> Usage:
        out = self.final
        generated = sum(len(c.token_ids) for c in out.outputs) if out else 0
        cached = out.num_cached_tokens if out else 0
        return Usage(self.prompt_tokens, generated, cached, self._reasoning_tokens())

    def _reasoning_tokens(self) -> int:
        return 0

    @abc.abstractmethod
    def _advance(self, index: int, new_token_ids: list[int], completion: CompletionOutput) -> list[ChatEvent]:
        """Events for choice ``index``'s new tokens."""

    @abc.abstractmethod
    def _end(self, index: int, completion: CompletionOutput) -> list[ChatEvent]:
        """Events that close choice ``index`` once it finished."""

    def _finish(self, index: int, completion: CompletionOutput) -> Finish:
        return Finish.of(completion)


class ChatRun(Run):
    """A chat request: each choice's tokens parsed by the recipe into reasoning / text / tool-call blocks."""

    def __init__(
        self, ctx: ServingContext, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        super().__init__(ctx, stream, prompt_token_ids, params.n)
        recipe = ctx.chat_recipe()
        self.parsers = [recipe.parser(prompt_token_ids, params.stop) for _ in range(params.n)]

    @property
    def messages(self) -> list[ParsedMessage]:
        return [p.result for p in self.parsers]

    def _advance(self, index: int, new_token_ids: list[int], completion: CompletionOutput) -> list[ChatEvent]:
        return self.parsers[index].feed(new_token_ids)

    def _end(self, index: int, completion: CompletionOutput) -> list[ChatEvent]:
        return self.parsers[index].finish(completion.stop_reason)

    def _finish(self, index: int, completion: CompletionOutput) -> Finish:
        return Finish.of(completion, called_tools=bool(self.parsers[index].result.tool_calls))

    def _reasoning_tokens(self) -> int:
        return sum(p.result.reasoning_tokens for p in self.parsers)


class TextRun(Run):
    """A plain completion: the engine's text, streamed without ever showing part of a stop string."""

    def __init__(
        self, ctx: ServingContext, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        super().__init__(ctx, stream, prompt_token_ids, params.n)
        self.buffers = [StopStringBuffer(params.stop) for _ in range(params.n)]

    @property
    def texts(self) -> list[str]:
        return [b.text for b in self.buffers]

    def _advance(self, index: int, new_token_ids: list[int], completion: CompletionOutput) -> list[ChatEvent]:
        if completion.finished:
            return []
        buffer = self.buffers[index]
        return _text_events(buffer.push(completion.text[len(buffer.text) :]))

    def _end(self, index: int, completion: CompletionOutput) -> list[ChatEvent]:
        # The engine's final text is authoritative (cut at the stop string, flushed).
        return _text_events(self.buffers[index].settle(completion.text))


class RunGroup(Updates):
    """Several runs as one (a completions request with several prompts): their updates merged as
    they come, choice indices offset by ``n`` per run, usage summed."""

    def __init__(self, runs: Sequence[Run], n: int) -> None:
        self.runs = list(runs)
        self.n = n

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        queue: asyncio.Queue[list[ChoiceUpdate] | BaseException | None] = asyncio.Queue()

        async def pump(offset: int, run: Run) -> None:
            try:
                async with aclosing(run.updates()) as updates:
                    async for step in updates:
                        queue.put_nowait([replace(u, index=u.index + offset) for u in step])
                queue.put_nowait(None)
            except Exception as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(pump(i * self.n, run)) for i, run in enumerate(self.runs)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    async def accepted(self) -> None:
        await asyncio.gather(*(run.accepted() for run in self.runs))

    def close(self) -> None:
        for run in self.runs:
            run.close()

    @property
    def usage(self) -> Usage:
        return total_usage(self.runs)


def total_usage(runs: Sequence[Run]) -> Usage:
    usages = [run.usage for run in runs]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


def _text_events(delta: str) -> list[ChatEvent]:
    return [BlockDelta(0, delta)] if delta else []


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
