"""How big a request is, as the router sees it before any worker does: prompt tokens and token limit.

The router does not run the chat recipe (that is the worker's job); it counts the tokens of every
string the prompt-bearing fields hold (message contents, roles, tool definitions, system text) with
the model's own tokenizer, plus token ids given directly (``/v1/completions`` accepts them). For a
chat this lands within a few template tokens per message of the worker's count, which is all a
routing decision needs. The tokenizer must be the workers' (the router checks the model fingerprint
at startup).
"""

from __future__ import annotations

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


def _leaves(value: Any) -> Iterator[str | int]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)


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
    tokens = ids + (len(tokenizer.encode("\n".join(texts), add_special_tokens=False)) if texts else 0)
    limit = next((body[k] for k in LIMIT_FIELDS if isinstance(body.get(k), int)), None)
    return RequestInfo(prompt_tokens=tokens, max_tokens=limit)
