"""Checks on request content made before any tokenizing: text that is not valid Unicode (a lone
UTF-16 surrogate, which JSON can spell as ``"\\ud800"``), prompts with more characters than the
context can possibly hold, and JSON schemas that the grammar backend cannot compile or that no finite
value satisfies.

Each returns what is wrong (and where) so the caller can answer 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from deepinfer.structured.satisfiable import unsatisfiable_reason
from deepinfer.web.errors import field_path

# A JSON escape of a UTF-16 surrogate; a body without one cannot hold a lone surrogate.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: bytes) -> tuple[str, str] | None:
    """``(field path, text)`` of the first string (or key) in a JSON body that holds a lone
    surrogate, or ``None``. Cheap for bodies without surrogate escapes (one regex scan). The caller
    reports it with ``deepinfer.text_input.require_valid_text``."""
    if SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: request validation reports that
    return _find(value, [])


def _find(value: Any, path: list[str | int]) -> tuple[str, str] | None:
    if isinstance(value, str):
        return (field_path(path) or "body", value) if _LONE_SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _LONE_SURROGATE.search(key):
            return field_path(path) or "body", key
        found = _find(item, [*path, key])
        if found is not None:
            return found
    return None


def max_token_chars(vocab: Sequence[str]) -> int:
    """The most characters one token can stand for (the longest vocabulary entry; for byte-level
    vocabularies an upper bound, since an entry's characters are at least as many as its text's)."""
    return max((len(t) for t in vocab), default=1)


def json_schema_error(schema: dict[str, Any] | str) -> str | None:
    """Why the grammar backend cannot compile ``schema`` (``None``: it can)."""
    import llguidance

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        return f"not a valid JSON schema: {exc}"
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return messages[0]
    return unsatisfiable_reason(json.loads(text))  # llguidance misses recursive contradictions
