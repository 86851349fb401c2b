"""A grammar that forces a tool call in DeepSeek's V3.1 format, arguments constrained by the tool's
JSON schema:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON arguments}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The control tokens are referenced by id (``<[id]>``), the only way special tokens may appear in
constrained output; everything else is ordinary text. Used for ``tool_choice`` "required" (one call
to any of the tools) or a named tool.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer.structured.closing import closed

MARKERS = ("tool_calls_begin", "tool_call_begin", "tool_sep", "tool_call_end", "tool_calls_end")


def tool_call_grammar(tools: Sequence[tuple[str, Mapping[str, Any]]], marker_ids: Mapping[str, int]) -> str:
    """Lark grammar (llguidance dialect) for exactly one call of one of ``tools`` (name, parameters
    schema). ``marker_ids`` maps each name in MARKERS to its token id."""
    if not tools:
        raise ValueError("forcing a tool call needs at least one tool")
    missing = [m for m in MARKERS if m not in marker_ids]
    if missing:
        raise ValueError(f"the tokenizer lacks the tool-call markers {missing}")
    ids = {m: f"<[{marker_ids[m]}]>" for m in MARKERS}
    rules = []
    for i, (name, schema) in enumerate(tools):
        # Compact JSON, and only the declared properties: flexible whitespace or open objects would let a
        # weak model pad the arguments forever.
        parameters = {
            **closed(dict(schema) or {"type": "object"}),
            "x-guidance": {"whitespace_flexible": False},
        }
        rules.append(
            f"call{i}: {ids['tool_call_begin']} {json.dumps(name)} {ids['tool_sep']} args{i} {ids['tool_call_end']}"
        )
        rules.append(f"args{i}: %json {json.dumps(parameters)}")
    calls = " | ".join(f"call{i}" for i in range(len(tools)))
    return "\n".join([f"start: {ids['tool_calls_begin']} ({calls}) {ids['tool_calls_end']}", *rules])
