"""Reading a request body that must be one JSON object of known fields.

The body is checked against the JSON bounds (``json_bounds``: depth, sizes, integer digits)
before it is decoded, so no body can make the decoder do unbounded work, and every problem is an
OpenAI-shaped 400: not JSON, not an object, or a field the route does not take (named, cut to a
bounded length). The routes check their fields' values themselves.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import msgspec

from batchgen.core.errors import InvalidRequest
from batchgen.core.requests.json_bounds import bounds_problem, integer_path
from batchgen.core.requests.json_escapes import escape_problem

#: The most characters of unknown field names an error repeats, and of the one it names as param.
MAX_NAMES_SHOWN = 200
MAX_PARAM_CHARS = 100


def json_object_body(raw: bytes, allowed: Collection[str]) -> dict[str, Any]:
    """The JSON object ``raw`` holds, whose fields are all in ``allowed``; else InvalidRequest."""
    too_big = bounds_problem(raw)
    if too_big is not None:
        path = integer_path(raw) if "integer" in too_big else None
        raise InvalidRequest(
            f"The request body holds {too_big}" + (f" at '{path}'." if path else "."), param=path
        )
    try:
        body = msgspec.json.decode(raw) if raw.strip() else None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {escape_problem(raw) or exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    unknown = sorted(set(body).difference(allowed))
    if unknown:
        raise InvalidRequest(
            f"Unknown field(s): {', '.join(unknown)[:MAX_NAMES_SHOWN]}", param=unknown[0][:MAX_PARAM_CHARS]
        )
    return body
