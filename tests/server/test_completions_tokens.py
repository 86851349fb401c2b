"""Control-token text in ``/v1/completions`` prompts (issue 34, defect 8), through the real test server
and the official ``openai`` client: prompt text is encoded as plain text, as the chat APIs encode
message text, unless the request sets ``parse_special_tokens: true``; ``echo`` returns the prompt
exactly; the model's BOS is still added."""

from __future__ import annotations

import httpx
import openai
import pytest

from deepinfer.recipe import tokens as T
from deepinfer.recipe.tokens import plain_text_encoder
from tests.server.conftest import MODEL_NAME, ServerHandle

CONTROL_PROMPT = f"{T.EOS}{T.USER}x"


def test_control_token_text_is_plain_text_by_default(
    server: ServerHandle, openai_client: openai.OpenAI
) -> None:
    tokenizer = server.engine.tokenizer
    plain = plain_text_encoder(tokenizer).encode(CONTROL_PROMPT)
    control_ids = {tokenizer.token_to_id(T.EOS), tokenizer.token_to_id(T.USER)}
    assert control_ids.isdisjoint(plain)
    expected = [tokenizer.bos_token_id, *plain]  # the BOS the model expects, then text tokens only
    assert len(expected) > len(tokenizer.encode(CONTROL_PROMPT)) == 4

    reply = openai_client.completions.create(
        model=MODEL_NAME, prompt=CONTROL_PROMPT, max_tokens=2, echo=True, extra_body={"ignore_eos": True}
    )
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.choices[0].text.startswith(CONTROL_PROMPT)

    streamed = openai_client.completions.create(
        model=MODEL_NAME, prompt=[CONTROL_PROMPT, "y"], max_tokens=1, echo=True, stream=True
    )
    texts: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts[0].startswith(CONTROL_PROMPT) and texts[1].startswith("y")


def test_parse_special_tokens_encodes_control_tokens(
    server: ServerHandle, openai_client: openai.OpenAI
) -> None:
    tokenizer = server.engine.tokenizer
    reply = openai_client.completions.create(
        model=MODEL_NAME,
        prompt=CONTROL_PROMPT,
        max_tokens=1,
        echo=True,
        extra_body={"parse_special_tokens": True, "ignore_eos": True},
    )
    assert reply.usage.prompt_tokens == len(tokenizer.encode(CONTROL_PROMPT)) == 4
    assert reply.choices[0].text.startswith(CONTROL_PROMPT)  # echo is the text as sent, markers too


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_parse_special_tokens_must_be_a_boolean(openai_client: openai.OpenAI, value) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=1, extra_body={"parse_special_tokens": value}
        )
    assert "parse_special_tokens" in str(info.value.body)


def test_parse_special_tokens_is_in_the_openapi_schema(server: ServerHandle) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    field = schema["components"]["schemas"]["CompletionRequest"]["properties"]["parse_special_tokens"]
    assert field["type"] == "boolean" and field["default"] is False
    assert "control" in field["description"]
