"""The serving core without HTTP: per-choice updates from cumulative engine outputs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deepinfer.core.messages import EngineStats
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.recipe import BlockDelta
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.generation import ChatRun, FinishReason, TextRun
from deepinfer.server.metrics import ServerMetrics
from tests.server.conftest import ServerHandle


class FakeStream:
    """Replays cumulative outputs like ``RequestStream``; records whether it was closed."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self._outputs = iter(outputs)
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return next(self._outputs)
        except StopIteration:
            raise StopAsyncIteration from None

    async def accepted(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def output(*completions: tuple, finished: bool) -> RequestOutput:
    """A cumulative output; each completion is (token ids, text, finish reason[, stop reason])."""
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(i, c[1], c[0], *c[2:]) for i, c in enumerate(completions)],
        finished=finished,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def context(server: ServerHandle) -> SimpleNamespace:
    recipe = server.app.state.serving.recipe
    return SimpleNamespace(chat_recipe=lambda: recipe, metrics=ServerMetrics(EngineStats, lambda: 0))


async def collect(run) -> list:
    return [update async for step in run.updates() for update in step]


def test_a_choice_that_ended_early_is_left_alone(server: ServerHandle) -> None:
    """With n > 1 the engine keeps listing a finished choice while the others run on."""
    tok = server.engine.tokenizer
    a, b = tok.encode("Hi", False), tok.encode(" there", False)
    stream = FakeStream(
        [
            output((a, "Hi", "stop"), (a, "Hi", None), finished=False),
            output((a, "Hi", "stop"), (a + b, "Hi there", "length"), finished=True),
        ]
    )
    params = SamplingParams(n=2, max_tokens=None)
    run = ChatRun(context(server), stream, [1, 2, 3], params)
    updates = asyncio.run(collect(run))
    assert [(u.index, u.finish.reason if u.finish else None) for u in updates] == [
        (0, FinishReason.STOP),
        (1, None),
        (1, FinishReason.LENGTH),
    ]
    assert [m.content for m in run.messages] == ["Hi", "Hi there"]
    assert stream.closed and run.usage.completion_tokens == len(a) + len(a + b)


def test_text_run_holds_back_a_stop_string_and_takes_the_engine_text(server: ServerHandle) -> None:
    stream = FakeStream(
        [
            output(([5], "Hello E", None), finished=False),
            output(([5, 6], "Hello ", "stop", "END"), finished=True),  # the engine cut "END" off
        ]
    )
    run = TextRun(context(server), stream, [1, 2, 3], SamplingParams(stop=["END"], max_tokens=None))
    updates = asyncio.run(collect(run))
    deltas = [e.text for u in updates for e in u.events if isinstance(e, BlockDelta)]
    assert deltas == ["Hello "] and run.texts == ["Hello "]
    assert updates[-1].finish.reason is FinishReason.STOP_STRING and updates[-1].finish.stop_string == "END"
