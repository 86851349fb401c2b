"""One-line descriptions of a bad spec file (``deepinfer plan --workload W.yaml``): YAML that does
not parse, and pydantic validation errors, each naming the field (``classes[0].rate_per_s``) and what
it accepts, instead of pydantic's multi-line dump. Used by ``WorkloadSpec.load``."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

MAX_LISTED = 3  # errors spelt out; the rest are counted


def yaml_problem(exc: Exception) -> str:
    """Where and why a YAML text failed to parse, in one line."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def validation_problems(exc: ValidationError, model: type[BaseModel]) -> str:
    """The validation errors of ``model`` as ``field: what is wrong (got X)`` joined by ``; `` (the
    first MAX_LISTED, then how many more); an unknown field lists the fields that are known."""
    errors = exc.errors(include_url=False)
    parts = [_describe(e, model) for e in errors[:MAX_LISTED]]
    if len(errors) > MAX_LISTED:
        parts.append(f"and {len(errors) - MAX_LISTED} more")
    return "; ".join(parts)


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    loc = error["loc"]
    where = _path(loc) or "the top level"
    if error["type"] == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        known = f"; known: {', '.join(owner.model_fields)}" if owner is not None else ""
        return f"{where}: unknown field{known}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{where}: required"
    got = error.get("input")
    if error["type"] == "model_type":  # a mapping was expected
        return f"{where}: must be a mapping of fields (got {type(got).__name__})"
    return f"{where}: {message} (got {_short(got)})"


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class found at ``loc`` inside ``model`` (list indices skipped), or None."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if (
            not (isinstance(current, type) and issubclass(current, BaseModel))
            or part not in current.model_fields
        ):
            return None
        current = _inner(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner(annotation: Any) -> Any:
    """The model type inside ``list[M]``, ``M | None`` and the like (else the annotation)."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, typing.Union, types.UnionType):
        models = [
            a
            for a in map(_inner, typing.get_args(annotation))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        return models[0] if models else annotation
    return annotation
