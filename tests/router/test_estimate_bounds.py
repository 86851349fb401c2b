"""The router's per-request work is bounded whatever the body holds (issue 34, defect 5): the
estimate walks any nesting depth without recursion and tokenizes at most ``TOKENIZED_CHARS``
characters; and a stream's last (or error) event is recognised in each API, for the request metrics
(defect 6)."""

from __future__ import annotations

import json

from deepinfer.model_zoo import default_model_path
from deepinfer.router.estimate import TOKENIZED_CHARS, count_text_tokens, estimate_request
from deepinfer.router.stream import stream_outcome
from deepinfer.tokenizer import Tokenizer


class CountingTokenizer:
    """The model's tokenizer, recording how many characters it was asked to encode."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer(default_model_path())
        self.encoded: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_a_huge_prompt_is_not_tokenized_whole() -> None:
    tok = CountingTokenizer()
    line = "def handler(request):\n    return request.body\n"
    text = line * (8 * TOKENIZED_CHARS // len(line))
    body = {"messages": [{"role": "user", "content": text}, {"role": "user", "content": text}]}
    info = estimate_request("/v1/chat/completions", body, tok)  # type: ignore[arg-type]
    assert tok.encoded == [TOKENIZED_CHARS]
    exact = 2 * len(tok.tokenizer.encode(text, add_special_tokens=False))
    assert 0.9 * exact < info.prompt_tokens < 1.1 * exact  # extrapolated from the head
    short = ["import os", "print(os.getcwd())"]
    assert count_text_tokens(short, tok) == len(
        tok.tokenizer.encode("\n".join(short), add_special_tokens=False)
    )  # type: ignore[arg-type]


def test_any_nesting_depth_is_walked_without_recursion() -> None:
    tok = CountingTokenizer()
    depth = 200_000
    nested: list = ["deep text"]
    for _ in range(depth):
        nested = [nested]
    body = {"prompt": nested, "max_tokens": 3}
    info = estimate_request("/v1/completions", body, tok)  # type: ignore[arg-type]
    assert info.max_tokens == 3 and info.prompt_tokens == len(
        tok.tokenizer.encode("deep text", add_special_tokens=False)
    )


def sse(data, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def test_stream_outcome_recognises_each_apis_end_and_errors() -> None:
    chunk = sse({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]})
    assert stream_outcome("chat", chunk) is None
    assert stream_outcome("chat", sse("[DONE]")) == "ok" == stream_outcome("completions", sse("[DONE]"))
    assert stream_outcome("chat", sse({"error": {"message": "engine died"}})) == "error"
    assert stream_outcome("messages", sse({"type": "content_block_delta"}, "content_block_delta")) is None
    assert stream_outcome("messages", sse({"type": "message_stop"}, "message_stop")) == "ok"
    assert (
        stream_outcome("messages", sse({"type": "error", "error": {"type": "api_error"}}, "error")) == "error"
    )
    done = {"type": "response.completed", "response": {"error": None}}
    assert stream_outcome("responses", sse(done)) == "ok"
    assert stream_outcome("responses", sse({"type": "response.incomplete"})) == "ok"
    assert stream_outcome("responses", sse({"type": "response.failed"})) == "error"
    assert stream_outcome("responses", sse({"type": "error", "message": "x"})) == "error"
    assert stream_outcome("responses", sse({"type": "response.output_text.delta", "delta": "x"})) is None
