"""Structured outputs under speculative decoding (both MTP modes): drafts are cut to the prefix the
grammar accepts, verified against masked sampling, and the output is the non-speculative one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model_zoo import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}
# One short prompt decoding (with drafts) while a long one is still in its chunked prompt: the step
# mixes constrained rows with and without drafts.
PROMPTS = ["def f(x):", "import os\n" * 200, "config = ", "x = {"]


@pytest.mark.parametrize("mode", ["mtp", "mtp-confidence"])
def test_speculative_json_schema_is_valid_and_lossless(mode: str) -> None:
    model = str(default_model_path())
    params = SamplingParams(temperature=0.0, max_tokens=80, json_schema=SCHEMA)
    plain = LLM(model, max_num_batched_tokens=64).generate(PROMPTS, params)
    spec_llm = LLM(model, speculative=mode, max_num_batched_tokens=64)
    spec = spec_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for out in spec:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    stats = spec_llm.engine.spec_stats
    assert stats.accepted_tokens > 0  # drafts were really verified and accepted under the grammar
    assert not spec_llm.engine.structured.matchers


def test_issue_reproduction_open_object_schema() -> None:
    """The reported call: it raised ``ValueError: Draft tokens must not be empty``."""
    llm = LLM(str(default_model_path()), speculative="mtp", max_num_batched_tokens=64)
    outs = llm.generate(
        ["def f(x):", "import os\n" * 200], SamplingParams(max_tokens=30, json_schema={"type": "object"})
    )
    assert all(o.text.startswith("{") and len(o.token_ids) > 0 for o in outs)


def test_drafts_are_cut_where_the_grammar_rejects_them() -> None:
    llm = LLM(str(default_model_path()))
    structured = llm.engine.structured
    tokenizer = llm.get_tokenizer()
    structured.add("r", SamplingParams(regex="abc"))
    a, b, c, z = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcz")
    assert structured.valid_drafts("r", [a], [b, c]) == [b, c]
    assert structured.valid_drafts("r", [a], [b, z, c]) == [b]
    assert structured.valid_drafts("r", [a], [z]) == []
    assert structured.valid_drafts("unconstrained", [a], [z]) == [z]
