"""Which JSON schemas admit a finite value (issue 34, defect 9): the productive-reference analysis
refuses schemas whose every value must contain itself, and nothing that a finite value satisfies."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer.structured.satisfiable import unsatisfiable_reason

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}

UNSATISFIABLE = {
    "required recursive ref (the issue's case)": ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, "#/$defs/n"),
    "root self-reference": (
        {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]},
        "#",
    ),
    "mutual recursion": (
        {
            "$defs": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 2},
            },
            "$ref": "#/$defs/a",
        },
        "#/$defs/a",
    ),
    "non-empty array of itself": ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
    "tuple of itself": ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, "#"),
    "additionalProperties of itself": (
        {"type": "object", "required": ["a"], "additionalProperties": {"$ref": "#"}},
        "#",
    ),
    "allOf of itself": (
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/definitions/x"}},
            "required": ["a"],
            "definitions": {"x": {"allOf": [{"$ref": "#/definitions/x"}]}},
        },
        "#/definitions/x",
    ),
    "only a self-reference": ({"$ref": "#/$defs/n", "$defs": {"n": {"$ref": "#/$defs/n"}}}, "#/$defs/n"),
    "anyOf without an exit": (
        {"anyOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n"}], "$defs": {"n": NODE}},
        "#/$defs/n",
    ),
    "escaped pointer": (
        {
            "$defs": {
                "a/b": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a~1b"}}, "required": ["x"]}
            },
            "$ref": "#/$defs/a~1b",
        },
        "#/$defs/a~1b",
    ),
}

SATISFIABLE = {
    "optional recursion": {"type": "object", "properties": {"next": {"$ref": "#"}}},
    "nullable next": {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    },
    "object or null": {
        "type": ["object", "null"],
        "properties": {"next": {"$ref": "#"}},
        "required": ["next"],
    },
    "untyped (any JSON value)": {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "tree with empty children": {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["children"],
    },
    "recursion with a const exit": {
        "type": "object",
        "properties": {"next": {"oneOf": [{"$ref": "#"}, {"const": "end"}]}},
        "required": ["next"],
    },
    "deep chain of definitions": {
        "$defs": {
            f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(50)
        }
        | {"d50": {"type": "string"}},
        "$ref": "#/$defs/d0",
    },
    "true": True,
    "plain object": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "remote ref (not modelled)": {"$ref": "https://example.com/schema.json"},
    "anchor ref (not modelled)": {"$ref": "#node"},
}


@pytest.mark.parametrize(("schema", "pointer"), UNSATISFIABLE.values(), ids=UNSATISFIABLE.keys())
def test_unsatisfiable_schemas_are_named(schema, pointer: str) -> None:
    reason = unsatisfiable_reason(schema)
    assert reason is not None and "no finite JSON value" in reason
    assert f"{pointer} can never be completed" in reason


@pytest.mark.parametrize("schema", SATISFIABLE.values(), ids=SATISFIABLE.keys())
def test_satisfiable_schemas_pass(schema) -> None:
    assert unsatisfiable_reason(schema) is None


def test_a_long_chain_is_checked_in_bounded_time() -> None:
    """20,000 chained definitions (about 1.5 MB of JSON), listed so that each proof unblocks the
    previous one: the worklist keeps the check near linear."""
    count = 20_000
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
        for i in range(count)
    }
    chain = {"$defs": {**defs, f"d{count}": {"type": "null"}}, "$ref": "#/$defs/d0"}
    start = time.monotonic()
    assert unsatisfiable_reason(chain) is None
    looped = json.loads(json.dumps(chain).replace('{"type": "null"}', '{"$ref": "#/$defs/d0"}'))
    assert "can never be completed" in unsatisfiable_reason(looped)
    assert time.monotonic() - start < 20
