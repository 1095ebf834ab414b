"""The bounds on one line's structured output, checked before its grammar is compiled.

Compiling a JSON schema into a grammar costs time that grows steeply with the schema (thousands
of optional properties take minutes), so a schema is looked at before anything compiles it:

- its size: the canonical JSON text (``max_schema_bytes``), the properties of all its objects
  together (``max_properties``), the values of all its enums (``max_enum_values``) and how deep
  its JSON nests (``max_depth``); a schema over one of them is that line's ``invalid_request``
  error line, naming the bound and the flag that changes it;
- keywords the grammar would silently ignore (``not``, ``if``/``then``/``else``,
  ``dependentRequired``, ``dependentSchemas``, and an ``allOf`` of more than one schema), which
  would make the line run unconstrained: they are refused the same way, as OpenAI's strict mode
  refuses them. An ``allOf`` of one schema is that schema; one whose ``type`` sets have nothing
  in common can never be satisfied and says so.

What passes is compiled off the decode loop under ``compile_timeout_s`` (``hf_grammar``). The
canonical text keeps the schema's key order (properties are generated in the order given) and is
the key of the compiled-grammar cache (``cache_size`` entries).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from batchgen.core.backends.base import RequestRejected

#: The schema a ``json_object`` response format stands for.
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
#: Keywords the grammar compiler ignores; a schema using them would run unconstrained.
UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
#: Keywords that only describe a schema (kept beside a one-schema ``allOf``).
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})
#: Keywords whose value is one subschema, a list of them, or an object of them.
_ONE = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@attrs.frozen
class GrammarBounds:
    """How big a schema may be, how long its compile may take, how many grammars are kept."""

    max_schema_bytes: int = 65536
    max_properties: int = 1000
    max_enum_values: int = 1000
    max_depth: int = 32
    compile_timeout_s: float = 10.0
    cache_size: int = 64


#: The bounds when no flag changes them.
DEFAULT_BOUNDS = GrammarBounds()


def _rejected(message: str) -> RequestRejected:
    return RequestRejected("invalid_request", f"'body.response_format.json_schema' {message}")


def schema_of(response_format: dict[str, Any]) -> Any:
    """The JSON schema a response format asks for (``json_object``: any object)."""
    if response_format.get("type") == "json_schema":
        return (response_format.get("json_schema") or {}).get("schema") or ANY_OBJECT
    return ANY_OBJECT


def checked_schema_text(response_format: dict[str, Any], bounds: GrammarBounds) -> str:
    """The canonical text of the line's schema, once it is within ``bounds``; else
    ``RequestRejected`` (``invalid_request``) saying which bound it passed."""
    schema = _unwrapped(schema_of(response_format))
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode("utf-8"))
    if size > bounds.max_schema_bytes:
        raise _rejected(
            f"is too large: {size} bytes, more than {bounds.max_schema_bytes} (--grammar-max-schema-bytes)"
        )
    properties, enum_values, depth = _measure(schema, bounds)
    if depth > bounds.max_depth:
        raise _rejected(f"is too large: it nests deeper than {bounds.max_depth} levels (--grammar-max-depth)")
    if properties > bounds.max_properties:
        raise _rejected(
            f"is too large: {properties} object properties, more than {bounds.max_properties} "
            "(--grammar-max-properties)"
        )
    if enum_values > bounds.max_enum_values:
        raise _rejected(
            f"is too large: {enum_values} enum values, more than {bounds.max_enum_values} "
            "(--grammar-max-enum-values)"
        )
    return text


def _measure(schema: Any, bounds: GrammarBounds) -> tuple[int, int, int]:
    """Properties and enum values in every subschema, and the deepest JSON nesting; refuses the
    keywords the compiler would ignore. Iterative, and it stops past the depth bound."""
    properties = enum_values = deepest = 0
    stack: list[tuple[Any, int, bool]] = [(schema, 1, True)]
    while stack:
        value, depth, is_schema = stack.pop()
        if not isinstance(value, dict | list):
            continue
        deepest = max(deepest, depth)  # objects and arrays, as json_bounds counts them
        if depth > bounds.max_depth:
            break
        if isinstance(value, list):
            stack.extend((item, depth + 1, False) for item in value)
            continue
        if not is_schema:
            stack.extend((item, depth + 1, False) for item in value.values())
            continue
        _refuse_ignored(value)
        for key, item in value.items():
            if key in _ONE and isinstance(item, dict):
                stack.append((item, depth + 1, True))
            elif key in _ONE + _MANY and isinstance(item, list):
                stack.append((item, depth + 1, False))
                stack.extend((sub, depth + 2, True) for sub in item)
            elif key in _NAMED and isinstance(item, dict):
                if key in ("properties", "patternProperties"):
                    properties += len(item)
                stack.append(({}, depth + 1, False))
                stack.extend((sub, depth + 2, True) for sub in item.values())
            elif key == "enum" and isinstance(item, list):
                enum_values += len(item)
                stack.append((item, depth + 1, False))
            else:
                stack.append((item, depth + 1, False))
    return properties, enum_values, deepest


def _refuse_ignored(schema: dict[str, Any]) -> None:
    for keyword in UNSUPPORTED:
        if keyword in schema:
            raise _rejected(f"uses '{keyword}', which structured output does not support")
    members = schema.get("allOf")
    if members is None:
        return
    if isinstance(members, list) and len(members) > 1:
        types = [_types(member) for member in members if isinstance(member, dict)]
        if "type" in schema:
            types.append(_types(schema))
        known = [kinds for kinds in types if kinds is not None]
        if known and not set.intersection(*known):
            raise _rejected(
                "can never be satisfied: its 'allOf' asks for a value of types "
                + " and ".join("/".join(sorted(kinds)) for kinds in known)
                + " at once"
            )
    raise _rejected(
        "uses 'allOf' of several schemas (or beside other keywords), which structured "
        "output does not support; an 'allOf' of one schema is accepted"
    )


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        kinds = {kind}
    elif isinstance(kind, list):
        kinds = {item for item in kind if isinstance(item, str)}
    else:
        return None
    if "number" in kinds:
        kinds.add("integer")  # an integer is a number: allOf number and integer is an integer
    return kinds


def _unwrapped(schema: Any) -> Any:
    """``allOf`` of one schema, beside annotations only, replaced by that schema, everywhere
    (pydantic writes ``{"allOf": [{"$ref": ...}], "description": ...}``). Iterative."""
    if not isinstance(schema, dict | list):
        return schema
    root = _unwrap_one(schema)
    stack = [root]
    while stack:
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in list(items):
            if isinstance(item, dict | list):
                replaced = _unwrap_one(item)
                value[key] = replaced
                stack.append(replaced)
    return root


def _unwrap_one(value: Any) -> Any:
    """A copy of ``value`` (one level), with a one-schema ``allOf`` folded in."""
    if isinstance(value, list):
        return list(value)
    copy = dict(value)
    while (
        isinstance(copy.get("allOf"), list)
        and len(copy["allOf"]) == 1
        and isinstance(copy["allOf"][0], dict)
        and set(copy) - {"allOf"} <= _ANNOTATIONS
    ):
        inner = dict(copy.pop("allOf")[0])
        for key, annotation in copy.items():
            inner.setdefault(key, annotation)
        copy = inner
    return copy
