"""Structured outputs on the trained tiny model at temperature 1.0: every output is valid."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model_zoo import default_model_path
from deepinfer.structured.backend import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "version": {"type": "integer", "minimum": 1, "maximum": 99},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "license": {"enum": ["MIT", "Apache-2.0", "PSF"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "author": {
            "type": "object",
            "properties": {"login": {"type": "string", "maxLength": 10}, "admin": {"type": "boolean"}},
            "required": ["login", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "version", "license", "tags", "author"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z][a-z0-9._]{0,15}@[a-z][a-z0-9]{0,11}\.(com|org|net)"
ARITHMETIC = r"""
start: expr
expr: term (ADD term)~0..3
term: factor (MUL factor)~0..2
factor: NUMBER | "(" inner ")"
inner: NUMBER (ADD NUMBER)~0..2
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[0-9]{1,3}/
"""
COUNT = 200


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(default_model_path()), max_num_seqs=64)


def generate(llm: LLM, prompt: str, **constraint) -> list[str]:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=256, **constraint) for s in range(COUNT)]
    outs = llm.generate([prompt] * COUNT, params)
    assert all(o.finish_reason == "stop" for o in outs), "every constrained output must complete"
    return [o.text for o in outs]


def test_nested_json_schema(llm: LLM) -> None:
    for text in generate(llm, "config = ", json_schema=SCHEMA):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("pattern", [DATE, EMAIL], ids=["date", "email"])
def test_regexes(llm: LLM, pattern: str) -> None:
    texts = generate(llm, "value = ", regex=pattern)
    assert all(re.fullmatch(pattern, t) for t in texts)
    assert len(set(texts)) > COUNT // 4  # temperature 1.0 really samples


def test_lark_arithmetic_grammar(llm: LLM) -> None:
    parser = lark.Lark(ARITHMETIC)
    for text in generate(llm, "x = ", grammar=ARITHMETIC):
        parser.parse(text)


def test_choice_and_speculation_together() -> None:
    spec = LLM(str(default_model_path()), speculative="mtp", num_draft_tokens=2)
    outs = spec.generate(
        ["mode = "] * 20,
        [SamplingParams(temperature=1.0, seed=s, choice=["read", "write", "append"]) for s in range(20)],
    )
    assert {o.text for o in outs} <= {"read", "write", "append"}


def test_unconstrained_requests_in_the_same_batch_are_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["def main():"], plain)[0].token_ids
    mixed = llm.generate(
        ["def main():", "n = "], [plain, SamplingParams(temperature=1.0, seed=1, regex=DATE)]
    )
    assert mixed[0].token_ids == alone and re.fullmatch(DATE, mixed[1].text)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            dict(
                json_schema={"type": "object", "properties": {"a": {"type": "string", "format": "made-up"}}}
            ),
            "format",
        ),
        (
            dict(json_schema={"type": "object", "patternProperties": {"^x": {}}, "unevaluatedItems": False}),
            "unevaluatedItems",
        ),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="start: missing_rule"), "grammar"),
        (  # recursive and required: llguidance compiles it, but no finite value exists
            dict(
                json_schema={
                    "$defs": {
                        "n": {
                            "type": "object",
                            "properties": {"next": {"$ref": "#/$defs/n"}},
                            "required": ["next"],
                        }
                    },
                    "$ref": "#/$defs/n",
                }
            ),
            "json_schema cannot be enforced: no finite JSON value satisfies it: #/\\$defs/n can never be completed",
        ),
    ],
)
def test_invalid_or_unsupported_constraints_are_rejected_by_name(
    llm: LLM, constraint: dict, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        llm.generate(["x"], SamplingParams(max_tokens=4, **constraint))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.matchers
