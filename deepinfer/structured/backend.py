"""The grammar backend seam, and its llguidance implementation.

A backend compiles a Constraint into a matcher bound to the model's tokenizer and fills token
bitmasks (int32, ceil(V/32) words per row, least-significant bit first — the layout llguidance and
xgrammar share). llguidance takes the ``tokenizers`` JSON directly, keeps special tokens out of
constrained text (only EOS, once the grammar is complete), and rejects unsupported JSON-Schema
keywords with an error that names them.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

import torch

from deepinfer.structured.constraint import Constraint
from deepinfer.structured.satisfiable import unsatisfiable_reason


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message says why (e.g. the unsupported keyword)."""


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one request; raises GrammarError for an invalid or unsupported constraint."""

    @abstractmethod
    def fill(self, rows: list[tuple[Any, int, list[int]]], bitmask: torch.Tensor) -> None:
        """For each (matcher, first row, drafts): write the mask of the matcher's current state into
        ``bitmask[first]`` and, for each draft, the mask after consuming the drafts before it into the
        following rows; matcher states are left unchanged."""

    @abstractmethod
    def consume(self, matcher: Any, tokens: list[int]) -> None:
        """Advance a matcher over accepted tokens."""

    @abstractmethod
    def valid_prefix(self, matcher: Any, tokens: list[int]) -> int:
        """How many leading ``tokens`` the matcher accepts from its current state (unchanged)."""


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.executor = llguidance.LLExecutor()

    def grammar(self, constraint: Constraint) -> str:
        m = self._llg.LLMatcher
        if constraint.kind == "regex":
            return m.grammar_from_regex(constraint.source)
        if constraint.kind == "json_schema":
            try:
                grammar = m.grammar_from_json_schema(
                    constraint.source, defaults={"whitespace_flexible": False}
                )
            except ValueError as exc:
                raise GrammarError(f"json_schema is not a valid JSON object: {exc}") from None
            problem = unsatisfiable_reason(json.loads(constraint.source))
            if problem is not None:
                raise GrammarError(f"json_schema cannot be enforced: {problem}")
            return grammar
        if constraint.kind == "grammar":
            return m.grammar_from_lark(_to_lark(constraint.source))
        choices = json.loads(constraint.source)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))

    def matcher(self, constraint: Constraint) -> Any:
        grammar = self.grammar(constraint)
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"{constraint.kind} is not supported: {messages[0]}")
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{constraint.kind} is not supported: {matcher.get_error()}")
        return matcher

    def fill(self, rows: list[tuple[Any, int, list[int]]], bitmask: torch.Tensor) -> None:
        import llguidance.torch as llgt

        # llguidance's draft variant refuses a row without drafts (a request still in its prompt, or
        # whose drafts the grammar cut to none), so such rows take the plain variant.
        drafted = [row for row in rows if row[2]]
        plain = [(m, i) for m, i, drafts in rows if not drafts]
        if drafted:
            llgt.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, bitmask)
        if plain:
            llgt.fill_next_token_bitmask_par(self.executor, plain, bitmask)

    def valid_prefix(self, matcher: Any, tokens: list[int]) -> int:
        return matcher.validate_tokens(tokens)

    def consume(self, matcher: Any, tokens: list[int]) -> None:
        matcher.consume_tokens(tokens)


def _to_lark(text: str) -> str:
    """A grammar in llguidance's Lark dialect: GBNF (llama.cpp's EBNF notation, ``root ::= ...``; told
    apart by its ``::=``) is converted, its ``root`` becoming ``start``; Lark text is kept as it is."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # the converter raises plain Exceptions for some syntax errors
        raise GrammarError(f"grammar is not valid GBNF: {exc}") from exc
