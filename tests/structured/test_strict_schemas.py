"""Strict JSON schemas (``response_format`` / ``text.format`` ``json_schema`` with ``strict: true``):
objects are closed, so a constrained answer never carries a key its schema does not name.

Property test at the constraint level: hypothesis generates schemas (nested objects, arrays, enums,
optional keys), the API's schema preparation closes them, and the engine's grammar matcher (bundled
tokenizer) is driven with random allowed tokens until it completes. Bounded strings, numbers and
arrays keep every walk finite; under an open schema the walk writes keys of its own and fails.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import SamplingParams
from deepinfer.model_zoo import default_model_path
from deepinfer.server.api.common import output_schema
from deepinfer.structured.closing import closed
from deepinfer.structured.manager import StructuredOutputs
from deepinfer.tokenizer import Tokenizer

MAX_STEPS = 400
NAMES = st.sampled_from(["a", "b", "id", "name", "tags", "x_1", "value", "properties", "type"])
LEAVES = st.one_of(
    st.just({"type": "integer", "minimum": -50, "maximum": 50}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 4)),
    st.lists(st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    ),
)


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
        required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        schema: dict[str, Any] = {"type": "object", "properties": props}
        if required:
            schema["required"] = required
        return schema

    return st.builds(build, st.dictionaries(NAMES, children, max_size=3), st.data())


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda s, n: {"type": "array", "items": s, "maxItems": n}, children, st.integers(0, 2)),
    ),
    max_leaves=8,
).filter(lambda s: s.get("type") == "object")


@pytest.fixture(scope="module")
def structured() -> tuple[StructuredOutputs, Tokenizer]:
    folder = default_model_path()
    tokenizer = Tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return StructuredOutputs(tokenizer, config["vocab_size"], frozenset(eos)), tokenizer


def walk(structured: StructuredOutputs, tokenizer: Tokenizer, schema: dict[str, Any], seed: int) -> str:
    """Text a matcher for ``schema`` accepts, built from uniformly random allowed tokens (EOS ends
    it); fails if the walk does not complete within MAX_STEPS tokens."""
    rng = random.Random(seed)
    structured.add("walk", SamplingParams(json_schema=schema, max_tokens=MAX_STEPS))
    eos = tokenizer.eos_token_id
    tokens: list[int] = []
    try:
        for _ in range(MAX_STEPS):
            mask = structured.start_masks([("walk", 0, [])], 1).result()[0]
            bits = (mask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = torch.nonzero(bits.view(-1)[: structured.vocab_size]).view(-1).tolist()
            assert allowed, f"the grammar allows no token after {tokenizer.decode(tokens)!r}"
            token = rng.choice(allowed)
            if token == eos:
                return tokenizer.decode(tokens)
            structured.accept("walk", [token])
            tokens.append(token)
    finally:
        structured.remove("walk")
    pytest.fail(f"no completion within {MAX_STEPS} tokens: {tokenizer.decode(tokens)[:200]!r}")


def undeclared_keys(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Paths of object keys in ``value`` that the matching schema's ``properties`` do not name."""
    found = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key, item in value.items():
            if key not in props:
                found.append(f"{path}.{key}")
            else:
                found += undeclared_keys(item, props[key], f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += undeclared_keys(item, schema.get("items", {}), f"{path}[{i}]")
    return found


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_strict_json_schema_never_yields_undeclared_keys(structured, schema, seed) -> None:
    backend, tokenizer = structured
    prepared = output_schema("json_schema", schema, "f", "f.schema", False, [], strict=True)
    text = walk(backend, tokenizer, prepared, seed)
    value = json.loads(text)
    assert undeclared_keys(value, schema) == [], (schema, text)
    jsonschema.validate(value, schema)


def test_without_strict_the_schema_is_kept_as_written() -> None:
    """Non-strict formats keep JSON Schema's open objects (the README says so)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert output_schema("json_schema", schema, "f", "f.schema", False, []) == schema
    assert output_schema("json_schema", schema, "f", "f.schema", False, [], strict=True) == {
        **schema,
        "additionalProperties": False,
    }


def test_closed_walks_schema_positions_only() -> None:
    """A property named like a keyword, data in enum/const/default, explicit openness and allOf
    branches are left alone; objects in properties, items, anyOf and $defs are closed."""
    obj = {"type": "object", "properties": {"k": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"type": {"type": "string"}}},
            "free": {"type": "object", "additionalProperties": {"type": "integer"}},
            "pattern": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
            "list": {"type": "array", "items": obj},
            "either": {"anyOf": [obj, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/thing"},
            "choice": {"enum": [{"properties": {}}], "default": {"type": "object"}},
            "both": {"allOf": [obj, {"type": "object", "properties": {"j": {"type": "string"}}}]},
        },
        "$defs": {"thing": obj},
    }
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert set(props) == set(schema["properties"])  # no "additionalProperties" property was added
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]
    assert props["free"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["pattern"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["thing"]["additionalProperties"] is False
    assert props["choice"] == schema["properties"]["choice"]
    assert all("additionalProperties" not in b for b in props["both"]["allOf"])
    assert "additionalProperties" not in schema  # the input is not modified
