"""Log-probabilities in OpenAI's two formats (chat's ``logprobs.content`` and the legacy
completions' parallel lists)."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.outputs import Logprob
from deepinfer.server.protocol.chat import TokenLogprob, TopLogprob
from deepinfer.server.protocol.completions import CompletionLogprobs


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)[:k]


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int
) -> list[TokenLogprob]:
    """One item per generated token: its text, log-probability, UTF-8 bytes and the ``k`` most likely."""
    out = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        out.append(
            TokenLogprob(
                token=chosen.decoded_token,
                logprob=chosen.logprob,
                bytes=list(chosen.decoded_token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode())
                    )
                    for lp in _top(entry, k)
                ],
            )
        )
    return out


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int, text_offset: int
) -> CompletionLogprobs:
    """The legacy format: parallel lists of tokens, log-probabilities, top-k dicts, text offsets."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        tokens.append(chosen.decoded_token)
        values.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in _top(entry, k)})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)
