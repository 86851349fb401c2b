"""Text with a lone surrogate is a ValueError naming the field, at every way into the engine."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.text_input import InvalidTextError, require_valid_text


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=64)


def test_require_valid_text() -> None:
    assert require_valid_text("héllo 🙂 \x00", "prompt") == "héllo 🙂 \x00"
    with pytest.raises(InvalidTextError, match=r"messages\[2\]\.content .* character 1 .*U\+DC00"):
        require_valid_text("a\udc00b", "messages[2].content")
    assert issubclass(InvalidTextError, ValueError)


def test_generate_names_the_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\] is not valid Unicode"):
        llm.generate(["fine", "a\ud800"], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.engine.add_request("r", "a\ud800", None, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.outputs.states
    assert llm.generate(["ok"], SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(stop=["fine", "x\ud800"]), r"stop\[1\]"),
        (dict(choice=["a", "\udfff"]), r"choice\[1\]"),
        (dict(regex="a\ud800"), "regex"),
        (dict(grammar='start: "\ud800"'), "grammar"),
        (dict(json_schema={"enum": ["\ud800"]}), "json_schema"),
        (dict(json_schema='{"enum": ["\ud800"]}'), "json_schema"),
    ],
)
def test_sampling_text_fields_are_checked(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field + " is not valid Unicode"):
        SamplingParams(**params)


def test_tokenizer_rejects_surrogates_with_a_value_error(llm: LLM) -> None:
    with pytest.raises(InvalidTextError):
        llm.get_tokenizer().encode("\ud800")
