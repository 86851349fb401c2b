"""Grammars in each accepted notation, end to end through ``LLM.generate``: GBNF (llama.cpp's EBNF
notation, ``root ::= ...``) and llguidance's Lark; a malformed GBNF grammar is a GrammarError."""

from __future__ import annotations

import re

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model_zoo import default_model_path
from deepinfer.structured.backend import GrammarError

# The same language written three ways: a version "v" MAJOR "." MINOR, optionally "-rc" DIGIT.
VERSION = re.compile(r"v[0-9]{1,2}\.[0-9]{1,2}(-rc[0-9])?")
GRAMMARS = {
    "gbnf-literal": ('root ::= "yes"', re.compile("yes")),
    "gbnf-ebnf-operators": (
        'root ::= "v" num "." num ("-rc" [0-9])?\nnum ::= [0-9] [0-9]?\n',
        VERSION,
    ),
    "lark": ('start: "v" NUM "." NUM ("-rc" /[0-9]/)?\nNUM: /[0-9]{1,2}/\n', VERSION),
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(default_model_path()))


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_grammar_outputs_match(llm: LLM, name: str) -> None:
    grammar, language = GRAMMARS[name]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=32, grammar=grammar) for s in range(16)]
    outs = llm.generate(["version = "] * 16, params)
    for out in outs:
        assert out.finish_reason == "stop" and language.fullmatch(out.text), out.text


def test_malformed_gbnf_is_rejected_by_name(llm: LLM) -> None:
    with pytest.raises(GrammarError, match="GBNF"):
        llm.generate(["x"], SamplingParams(max_tokens=4, grammar='root ::= "unclosed'))
    with pytest.raises(GrammarError, match="grammar"):
        llm.generate(["x"], SamplingParams(max_tokens=4, grammar="root ::= missing"))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.matchers
