"""The shape of a ``response_format`` (structured output) as a batch line may give it.

OpenAI's forms are accepted: ``{"type": "text"}``, ``{"type": "json_object"}`` and
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``. Only
the shape is checked here, at upload; whether the schema compiles is the engine's business, and a
schema it cannot compile becomes that request's error line. Whether the chosen model honours
``response_format`` at all is ``backends.capabilities``'s decision.
"""

from __future__ import annotations

import re
from typing import Any

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def response_format_problem(value: Any) -> str | None:
    """``"must be ..."`` when ``value`` is not a response_format OpenAI accepts; None when it is."""
    if not isinstance(value, dict):
        return 'must be an object such as {"type": "json_object"}'
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        return f"'type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}"
    if kind != "json_schema":
        return None
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        return "of type json_schema needs a 'json_schema' object with 'name' and 'schema'"
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        return "'json_schema.name' must be 1-64 letters, digits, '_' or '-'"
    if not isinstance(spec.get("schema", {}), dict):
        return "'json_schema.schema' must be a JSON Schema object"
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        return "'json_schema.strict' must be a boolean"
    return None


def from_responses_text(text: Any) -> dict[str, Any] | None:
    """The chat ``response_format`` for a Responses body's ``text.format`` (None: plain text)."""
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return None
    fmt = text["format"]
    if fmt.get("type") != "json_schema":
        return None if fmt.get("type") in (None, "text") else {"type": fmt.get("type")}
    json_schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": json_schema}
