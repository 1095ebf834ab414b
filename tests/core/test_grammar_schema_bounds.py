"""The structured-output schema bounds (``hf_grammar_bounds``), checked without a model.

A schema is measured over every subschema (properties of all objects together, enum values of
all enums together, JSON nesting, compact bytes): within every bound it passes, past any one it is
an ``invalid_request`` naming that bound's flag. Keywords the compiler would ignore are refused,
and a one-schema ``allOf`` is unwrapped. The canonical text keeps key order.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends.base import RequestRejected
from batchgen.core.backends.hf_grammar_bounds import DEFAULT_BOUNDS, GrammarBounds, checked_schema_text

BOUNDS = GrammarBounds(max_schema_bytes=20000, max_properties=40, max_enum_values=40, max_depth=12)


def _format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _refusal(schema: Any, bounds: GrammarBounds = BOUNDS) -> str:
    with pytest.raises(RequestRejected) as caught:
        checked_schema_text(_format(schema), bounds)
    assert caught.value.code == "invalid_request"
    assert caught.value.message.startswith("'body.response_format.json_schema' ")
    return caught.value.message


def _objects(sizes: list[int], enum: int) -> dict[str, Any]:
    """Nested objects with ``sizes[i]`` properties at level i, and one enum of ``enum`` values."""
    schema: dict[str, Any] = {"enum": [f"v{i}" for i in range(enum)]} if enum else {"type": "null"}
    for level, size in enumerate(reversed(sizes)):
        properties = {f"l{level}p{i}": {"type": "integer"} for i in range(size - 1)}
        schema = {"type": "object", "properties": {"inner": schema, **properties}}
    return schema


@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4), enum=st.integers(0, 40))
def test_a_schema_within_every_bound_passes_with_its_key_order(sizes: list[int], enum: int) -> None:
    schema = _objects(sizes, enum)
    if sum(sizes) > BOUNDS.max_properties:
        return
    text = checked_schema_text(_format(schema), BOUNDS)
    assert json.loads(text) == schema and text == json.dumps(schema, separators=(",", ":"))


@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=5), enum=st.integers(0, 200))
def test_properties_and_enum_values_count_over_all_subschemas(sizes: list[int], enum: int) -> None:
    schema = _objects(sizes, enum)
    wide = GrammarBounds(max_schema_bytes=10**7, max_properties=40, max_enum_values=40, max_depth=64)
    if sum(sizes) > 40:
        assert f"{sum(sizes)} object properties" in _refusal(schema, wide)
        assert "--grammar-max-properties" in _refusal(schema, wide)
    elif enum > 40:
        assert f"{enum} enum values, more than 40 (--grammar-max-enum-values)" in _refusal(schema, wide)
    else:
        checked_schema_text(_format(schema), wide)


@given(depth=st.integers(1, 60), wrapper=st.sampled_from(["items", "anyOf", "properties", "$defs"]))
def test_nesting_deeper_than_the_bound_is_refused(depth: int, wrapper: str) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        if wrapper == "items":
            schema = {"type": "array", "items": schema}
        elif wrapper == "anyOf":
            schema = {"anyOf": [schema, {"type": "null"}]}
        elif wrapper == "properties":
            schema = {"type": "object", "properties": {"a": schema}}
        else:
            schema = {"$defs": {"a": schema}, "type": "integer"}
    nesting = 1 + depth * (1 if wrapper == "items" else 2)
    if nesting > BOUNDS.max_depth:
        assert "--grammar-max-depth" in _refusal(schema)
    else:
        checked_schema_text(_format(schema), BOUNDS)


@given(extra=st.integers(1, 100000))
def test_a_schema_over_the_byte_bound_is_refused_with_its_size(extra: int) -> None:
    schema = {"type": "string", "description": ""}
    base = len(json.dumps(schema, separators=(",", ":")))
    schema["description"] = "é" * ((BOUNDS.max_schema_bytes - base) // 2 + extra)  # 2 bytes each
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    assert f"is too large: {size} bytes, more than 20000 (--grammar-max-schema-bytes)" in _refusal(schema)


@given(
    keyword=st.sampled_from(["not", "if", "then", "else", "dependentRequired", "dependentSchemas"]),
    depth=st.integers(0, 4),
)
def test_keywords_the_compiler_ignores_are_refused_wherever_they_are(keyword: str, depth: int) -> None:
    schema: dict[str, Any] = {"type": "string", keyword: {}}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    assert f"uses '{keyword}'" in _refusal(schema)


def test_a_keyword_name_used_as_a_property_name_or_a_value_is_no_keyword() -> None:
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "allOf": {"type": "integer", "default": {"not": 1}}},
        "examples": [{"if": 1}],
    }
    checked_schema_text(_format(schema), BOUNDS)


@given(
    first=st.sampled_from(["string", "boolean", "object", "array", "null"]),
    second=st.sampled_from(["integer", "number"]),
)
def test_allof_of_disjoint_types_can_never_be_satisfied(first: str, second: str) -> None:
    message = _refusal({"allOf": [{"type": first}, {"type": second}]})
    assert "can never be satisfied" in message and first in message and second in message


def test_allof_of_several_compatible_schemas_is_refused_and_of_one_is_unwrapped() -> None:
    assert "'allOf' of several" in _refusal({"allOf": [{"type": "number"}, {"type": "integer"}]})
    wrapped = {"allOf": [{"$ref": "#/$defs/A"}], "description": "an A"}
    schema = {"$defs": {"A": {"type": "integer"}}, "type": "object", "properties": {"a": wrapped}}
    text = checked_schema_text(_format(schema), BOUNDS)
    assert json.loads(text)["properties"]["a"] == {"$ref": "#/$defs/A", "description": "an A"}


def test_the_defaults_are_the_documented_ones() -> None:
    assert (
        GrammarBounds(
            max_schema_bytes=65536,
            max_properties=1000,
            max_enum_values=1000,
            max_depth=32,
            compile_timeout_s=10.0,
            cache_size=64,
        )
        == DEFAULT_BOUNDS
    )
    checked_schema_text({"type": "json_object"}, DEFAULT_BOUNDS)
