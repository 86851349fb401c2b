"""Incremental detokenization that never emits half of a multi-byte character.

Each new token re-decodes a short window of recent tokens; text is emitted only once it no longer
ends in U+FFFD (an incomplete UTF-8 sequence), so streamed deltas concatenate to the final text.
"""

from __future__ import annotations

from deepinfer.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded as left context (spacing rules of some tokenizers need it)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Add one generated token; returns the text it completes (possibly empty)."""
        self.tokens.append(token)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: emit whatever is still held back (an incomplete character
        decodes as U+FFFD)."""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta
