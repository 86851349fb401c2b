"""How big a request is, as the router sees it before any worker does: prompt tokens and token limit.

The router does not run the chat recipe (that is the worker's job); it counts the tokens of every
string the prompt-bearing fields hold (message contents, roles, tool definitions, system text) with
the model's own tokenizer, plus token ids given directly (``/v1/completions`` accepts them). For a
chat this lands within a few template tokens per message of the worker's count, which is all a
routing decision needs. The tokenizer must be the workers' (the router checks the model fingerprint
at startup).

The cost is bounded whatever the body holds: the fields are walked without recursion (any nesting
depth), and at most :data:`TOKENIZED_CHARS` characters are tokenized; a longer prompt's count is
extrapolated from theirs (an estimate is all routing needs: the worker counts exactly and refuses a
prompt its context cannot hold).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from deepinfer.router.policies import RequestInfo
from deepinfer.tokenizer import Tokenizer

# per API path: the body fields that make up the prompt, and the names of its output token limit
PROMPT_FIELDS = {
    "/v1/completions": ("prompt", "suffix"),
    "/v1/chat/completions": ("messages", "tools"),
    "/v1/responses": ("input", "instructions", "tools"),
    "/v1/messages": ("system", "messages", "tools"),
}
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
TOKENIZED_CHARS = 1 << 18  # the most prompt characters tokenized for an estimate (the rest extrapolated)


def _leaves(value: Any) -> Iterator[str | int]:
    """The strings and integers in ``value``, depth first, in order (an explicit stack: no recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))


def count_text_tokens(texts: list[str], tokenizer: Tokenizer, limit: int = TOKENIZED_CHARS) -> int:
    """Tokens of ``texts`` joined by newlines: exact up to ``limit`` characters; a longer text's count
    is that of its first ``limit`` characters, scaled by its length."""
    if not texts:
        return 0
    total = sum(map(len, texts)) + len(texts) - 1
    head: list[str] = []
    size = 0
    for t in texts:
        if size >= limit:
            break
        head.append(t[: limit - size])
        size += len(head[-1]) + 1
    text = "\n".join(head)
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    return tokens if total <= len(text) else math.ceil(tokens * total / len(text))


def estimate_request(path: str, body: Mapping[str, Any], tokenizer: Tokenizer) -> RequestInfo:
    """Estimated prompt tokens and the output limit of a request to ``path`` (one of
    :data:`PROMPT_FIELDS`); a ``ValueError`` for another path."""
    if path not in PROMPT_FIELDS:
        raise ValueError(f"the router does not route {path!r} (routed: {', '.join(PROMPT_FIELDS)})")
    texts: list[str] = []
    ids = 0
    for name in PROMPT_FIELDS[path]:
        for leaf in _leaves(body.get(name)):
            if isinstance(leaf, str):
                texts.append(leaf)
            else:
                ids += 1
    tokens = ids + count_text_tokens(texts, tokenizer)
    limit = next((body[k] for k in LIMIT_FIELDS if isinstance(body.get(k), int)), None)
    return RequestInfo(prompt_tokens=tokens, max_tokens=limit)
