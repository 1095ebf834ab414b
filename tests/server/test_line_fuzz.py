"""Accepted means runnable: arbitrary JSON lines around valid ones either fail the upload with a
400 naming a line, or run to a completed batch with exactly one result line per request and no
``internal_error`` among them.

Hypothesis builds files from valid chat and completions lines, lines with one field replaced by
arbitrary JSON (random keys, types, nesting, unicode, huge integers, deep nesting) and lines that
are arbitrary JSON altogether, and drives them through the in-process server (simulated backend).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.helpers import (
    TERMINAL,
    chat_line,
    completion_line,
    file_lines,
    jsonl,
    post_batch,
    post_file,
    wait_for_status,
)

pytestmark = pytest.mark.fuzz  # runs in nox -s tests, not in the fast unit loop

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"x": value}
    return value


_deep = st.integers(min_value=50, max_value=1500).map(_nested)
_anything = _json | _deep
#: Body fields the executor reads, and message and content-part fields.
_BODY_FIELDS = (
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "model",
)


@st.composite
def _line(draw: st.DrawFn, index: int) -> Any:
    custom_id = f"req-{index}"
    chat = draw(st.booleans())
    line = chat_line(custom_id) if chat else completion_line(custom_id, "Once upon a time")
    kind = draw(
        st.sampled_from(
            ["valid"] * 4 + ["body-field", "extra", "message", "part", "envelope", "whole", "empty-input"]
        )
    )
    body = line["body"]
    if kind == "empty-input":  # an assistant turn that only calls a tool; an empty prompt
        if chat:
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            body["messages"].append({"role": "assistant", "content": None, "tool_calls": [call]})
            body["messages"].append({"role": "tool", "tool_call_id": "c1", "content": "done"})
        else:
            body["prompt"] = ""
    elif kind == "body-field":
        body[draw(st.sampled_from(_BODY_FIELDS))] = draw(_anything)
    elif kind == "extra":
        body[draw(st.text(max_size=10))] = draw(_anything)
    elif kind == "message" and chat:
        body["messages"][0][draw(st.sampled_from(["role", "content", "name"]))] = draw(_anything)
    elif kind == "part" and chat:
        part: dict[str, Any] = {"type": "text", "text": "hello"}
        part[draw(st.sampled_from(["type", "text", "extra"]))] = draw(_anything)
        body["messages"][0]["content"] = [part]
    elif kind == "envelope":
        line[draw(st.sampled_from(["custom_id", "method", "url", "body", "other"]))] = draw(_anything)
    elif kind == "whole":
        return draw(_anything)
    return line


@st.composite
def _files(draw: st.DrawFn) -> list[Any]:
    count = draw(st.integers(min_value=1, max_value=4))
    return [draw(_line(index)) for index in range(count)]


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(lines=_files())
def test_a_file_is_refused_by_line_or_every_request_ends_with_one_line(
    api: httpx.Client, lines: list[Any]
) -> None:
    content = jsonl(*[json.dumps(line, ensure_ascii=False).encode() for line in lines])
    response = post_file(api, content)
    event(f"upload answered {response.status_code}")
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["code"] == "invalid_batch_file"
        assert re.search(r"line [1-4]: ", error["message"]), error["message"]
        return
    assert response.status_code == 200, response.text
    endpoint = lines[0]["url"]
    created = post_batch(api, response.json()["id"], endpoint)
    assert created.status_code == 200, created.text
    batch = wait_for_status(api, created.json()["id"], TERMINAL, timeout_s=30)
    assert batch["status"] == "completed", batch
    results = file_lines(api, batch["output_file_id"]) + file_lines(api, batch["error_file_id"])
    assert sorted(result["custom_id"] for result in results) == sorted(line["custom_id"] for line in lines)
    counts = batch["request_counts"]
    assert counts["total"] == len(lines)
    assert counts["completed"] + counts["failed"] == len(lines)
    errors = [result["error"] for result in results if result["error"] is not None]
    assert counts["failed"] == len(errors)
    # An accepted line never raises when it runs: the simulated backend refuses only content
    # parts that are not text, and that is the request's own fault.
    assert all(error["code"] == "invalid_request" for error in errors), errors
