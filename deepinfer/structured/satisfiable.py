"""Whether a JSON schema admits any finite JSON value: a schema whose every value must contain
itself (a recursive ``$ref`` behind ``required`` properties, ``minItems`` or ``allOf``) compiles to a
grammar that can never complete, so constrained decoding would emit ``{`` and stall.

llguidance finds non-recursive contradictions itself (``"Unsatisfiable schema: required property 'a'
is unsatisfiable"``) but not recursive ones. This module computes which ``$ref`` targets are
*productive* (can be completed by a finite value) as a least fixed point over the schema's local
references, the way a grammar's productive nonterminals are found. It only claims unsatisfiability
it can prove: keywords it does not model (``not``, ``if``, patterns, formats, remote refs ...) count as
satisfiable, so what it refuses is truly unsatisfiable, and the rest is left to the grammar backend.

Called by the API server's schema checks (400 naming the field) and by the grammar backend (a
``GrammarError`` for offline requests); pure Python on a parsed schema, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

_SCALAR_TYPES = frozenset({"null", "boolean", "number", "integer", "string"})
_ALL_TYPES = (*sorted(_SCALAR_TYPES), "object", "array")


def unsatisfiable_reason(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema`` (naming the ``$ref`` target that can never be
    completed), or ``None`` when one may. ``schema`` is a parsed JSON schema (a dict or a bool)."""
    try:
        return _Analysis(schema).reason()
    except RecursionError:
        return "it is nested too deeply to check (recursion limit); flatten it or use $defs"
    except _TooComplex:
        return f"it is too large to check (over {MAX_VISITS:,} subschema visits); simplify it"


class _TooComplex(Exception):
    """The analysis ran past MAX_VISITS."""


#: Schema nodes one check may visit in all (a worklist keeps it near linear; the cap bounds the
#: pathological rest, such as a 1 MB body of chained definitions).
MAX_VISITS = 1_000_000


class _Analysis:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.productive: set[str] = set()  # local $ref pointers known to be completable
        self.consulted: set[str] = set()  # unproven refs the current check looked up
        self.visits = 0

    def reason(self) -> str | None:
        targets = {
            ref: target for ref in _local_refs(self.root) if (target := self._resolve(ref)) is not None
        }
        # Worklist: a target whose check failed is checked again only once a ref that check looked up
        # has been proven, since nothing else can change its outcome.
        waiting: dict[str, list[str]] = {}
        queue = list(targets)
        while queue:
            ref = queue.pop()
            if ref in self.productive:
                continue
            self.consulted = set()
            if self.completable(targets[ref]):
                self.productive.add(ref)
                queue.extend(waiting.pop(ref, ()))
            else:
                for needed in self.consulted:
                    waiting.setdefault(needed, []).append(ref)
        if self.completable(self.root):
            return None
        stuck = [ref for ref in _local_refs(self.root, self._resolve) if ref not in self.productive]
        if stuck:
            return (
                f"no finite JSON value satisfies it: {stuck[0]} can never be completed (each of its values "
                "must contain another through $ref, by required properties, minItems or allOf)"
            )
        return "no finite JSON value satisfies it"

    def _resolve(self, ref: str) -> Any:
        """The subschema a local reference ("#", "#/$defs/n") points at; None if it points nowhere
        (the grammar backend reports that)."""
        if ref != "#" and not ref.startswith("#/"):
            return None  # an anchor ("#name"): not modelled
        node = self.root
        for raw in ref[2:].split("/") if ref != "#" else []:
            key = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node

    def completable(self, schema: Any) -> bool:
        """Whether ``schema`` has a finite value, given the $ref targets proven productive so far
        (a local ref not yet proven counts as not completable; anything unmodelled as completable)."""
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise _TooComplex
        if schema is False:
            return False
        if not isinstance(schema, Mapping):
            return True
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref not in self.productive and self._resolve(ref) is not None:
            self.consulted.add(ref)
            return False
        parts = schema.get("allOf")
        if isinstance(parts, list) and not all(self.completable(p) for p in parts):
            return False
        for key in ("anyOf", "oneOf"):
            parts = schema.get(key)
            if isinstance(parts, list) and parts and not any(self.completable(p) for p in parts):
                return False
        if "const" in schema or "enum" in schema:
            return True  # a literal value (whether it also meets the rest is the backend's to say)
        return any(self._type_completable(schema, t) for t in _types(schema))

    def _type_completable(self, schema: Mapping[str, Any], kind: str) -> bool:
        if kind == "object":
            return self._object_completable(schema)
        if kind == "array":
            return self._array_completable(schema)
        return True

    def _object_completable(self, schema: Mapping[str, Any]) -> bool:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        for name in required if isinstance(required, list) else []:
            if name in properties:
                if not self.completable(properties[name]):
                    return False
            elif not schema.get("patternProperties"):  # a pattern may match the name: not modelled
                extra = schema.get("additionalProperties", True)
                if not self.completable(extra):
                    return False
        return True

    def _array_completable(self, schema: Mapping[str, Any]) -> bool:
        min_items = schema.get("minItems", 0)
        min_items = min_items if isinstance(min_items, int) and not isinstance(min_items, bool) else 0
        prefix = schema.get("prefixItems")
        items = schema.get("items", True)
        if isinstance(items, list):  # the draft-4 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        needed = prefix[:min_items]
        if min_items > len(prefix):
            needed = [*needed, items]
        return all(self.completable(s) for s in needed)


def _types(schema: Mapping[str, Any]) -> tuple[str, ...]:
    """The JSON types ``schema`` allows (all of them when it does not say)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return tuple(kind)
    return _ALL_TYPES


def _local_refs(node: Any, follow: Callable[[str], Any] | None = None) -> list[str]:
    """The distinct local ``$ref`` s ("#...") of the schema document, in the order a depth-first walk
    from ``node`` meets them; with ``follow`` (ref -> target), the walk also enters each target, so
    only references reachable from ``node`` count."""
    seen: dict[str, None] = {}
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in seen:
                seen[ref] = None
                if follow is not None:
                    stack.append(follow(ref))
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return list(seen)
