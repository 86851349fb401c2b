"""Validation of text that enters the engine from users: prompts, stop strings, grammars, choices.

A Python ``str`` may hold lone surrogates (``"\\ud800"``: JSON's ``\\ud800`` escape decodes to one), which
no tokenizer, grammar compiler or UTF-8 encoder accepts; they are rejected here, at the boundary, with
the name of the field, instead of failing deep inside as a TypeError. Used by ``SamplingParams``,
``LLMEngine.add_request``, ``LLM.generate`` and the API server.
"""

from __future__ import annotations


class InvalidTextError(ValueError):
    """A text field is not valid Unicode (it holds a lone surrogate); the message names the field."""


def require_valid_text(text: str, field: str) -> str:
    """Return ``text`` unchanged if it encodes as UTF-8; else raise InvalidTextError naming ``field``
    (e.g. ``"prompt"``, ``"stop[1]"``, ``"messages[0].content"``) and where the first bad character is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTextError(
            f"{field} is not valid Unicode text: character {exc.start} is a lone surrogate "
            f"(U+{ord(text[exc.start]):04X}); send UTF-8 text, with surrogate pairs joined"
        ) from None
    return text
