"""What a request asks its output to follow, from its SamplingParams."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from deepinfer.sampling_params import SamplingParams

Kind = Literal["regex", "json_schema", "grammar", "choice"]


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: Kind
    source: str  # the regex, the schema as JSON text, the grammar text, or the choices as a JSON list

    @classmethod
    def of(cls, params: SamplingParams) -> Constraint | None:
        if params.regex is not None:
            return cls("regex", params.regex)
        if params.json_schema is not None:
            schema = params.json_schema
            return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
        if params.grammar is not None:
            return cls("grammar", params.grammar)
        if params.choice is not None:
            return cls("choice", json.dumps(params.choice))
        return None
