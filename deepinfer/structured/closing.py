"""Closing a JSON schema's objects: the ``strict`` reading of a schema that OpenAI's strict structured
outputs and vLLM's default grammar backend use, where an object may hold only the keys its
``properties`` name unless it says otherwise (``additionalProperties``: true or a schema, or
``patternProperties``).

Plain JSON Schema leaves objects open (a missing ``additionalProperties`` means any further key with
any value), and llguidance follows it, so an unconstrained model may pad an answer with keys the
caller never asked for. Used for ``response_format`` / ``text.format`` ``json_schema`` with
``strict: true`` and for the arguments of forced tool calls. Pure function on a parsed schema.
"""

from __future__ import annotations

from typing import Any

#: Keywords whose value is one subschema.
_ONE = (
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
#: Keywords whose value maps names to subschemas.
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is a list of subschemas.
_LIST = ("anyOf", "oneOf", "prefixItems", "items")


def closed(schema: Any) -> Any:
    """A copy of ``schema`` (a parsed JSON schema: dict or bool) in which every object schema (one
    whose ``type`` is or includes ``"object"``, or that has ``properties``) without
    ``additionalProperties`` or ``patternProperties`` gets ``additionalProperties: false``.

    Only schema positions are walked (``properties`` values, ``items``, ``anyOf`` branches, ``$defs``
    ...), never data (``enum``, ``const``, ``default``, ``examples``), so a property named
    ``properties`` or an enum of objects is left alone. ``allOf`` is the exception: JSON Schema checks
    each branch's ``additionalProperties`` against that branch's own ``properties`` only, so closing
    the branches (or the schema that holds them) would refuse the keys the other branches declare;
    those objects stay as open as written, and only the schemas nested inside them are closed."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], in_all_of=False)
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, in_all_of=False) for name, sub in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub, in_all_of=False) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(sub, in_all_of=True) for sub in out["allOf"]]
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    opened = any(
        k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    )
    if is_object and not opened and not in_all_of:
        out["additionalProperties"] = False
    return out
