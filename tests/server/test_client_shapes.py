"""Details strict clients check (issue 35): strict JSON schemas end to end, the exact shapes of
chat messages, Responses items, Anthropic's model list and ``/metrics``, and refusals of what the
server does not support."""

from __future__ import annotations

import json

import openai

from tests.server.conftest import MODEL_NAME

OPEN_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}}


def test_strict_json_schema_closes_objects_end_to_end(openai_client: openai.OpenAI) -> None:
    """The random model at temperature 1 under a strict schema that does not say
    ``additionalProperties``: every answer completes and holds no key beyond ``city``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": OPEN_SCHEMA, "strict": True}}
    for seed in range(4):
        reply = openai_client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Which city?"}],
            response_format=fmt,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
        )
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        assert set(json.loads(reply.choices[0].message.content)) <= {"city"}
        response = openai_client.responses.create(
            model=MODEL_NAME,
            input="Which city?",
            text={"format": {"type": "json_schema", "name": "c", "schema": OPEN_SCHEMA, "strict": True}},
            max_output_tokens=40,
            temperature=1.0,
        )
        assert response.status == "completed", response.output_text
        assert set(json.loads(response.output_text)) <= {"city"}
