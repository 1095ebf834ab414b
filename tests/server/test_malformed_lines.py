"""Malformed lines are the line's problem, never the server's: byte-level mutations of valid lines
sent through both ways a batch file arrives (``POST /v1/files`` and the Uploads API's complete,
its parts in order and out of order) are answered 200 or 400 with the OpenAI-shaped error, never
a 5xx. A line whose first field has the wrong type and that is not JSON after it (``{"custom_id":
5, ...}x``) once raised an uncaught decode error.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.helpers import api_error, chat_line, completion_line, jsonl, post_file

VALID_LINES = (
    json.dumps(chat_line("a-1")).encode(),
    json.dumps(chat_line("a-2", "Hi", max_tokens=3, temperature=0.5)).encode(),
    json.dumps(completion_line("b-1", "Once upon a time")).encode(),
)
#: Bytes a mutation inserts: JSON's own punctuation and values of other types, and a few that are
#: not JSON at all.
PIECES = (b"x", b"5", b"}", b"{", b"]", b"[", b'"', b",", b":", b"null", b"true", b"-1e999", b"\\", b"\xff")


@st.composite
def mutated_line(draw: st.DrawFn) -> bytes:
    """A valid line with one to three byte-level changes: a piece inserted, a span deleted, a
    byte replaced, a string value swapped for a number, or garbage after the end."""
    line = bytearray(draw(st.sampled_from(VALID_LINES)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("insert", "delete", "replace", "retype", "trail")))
        at = draw(st.integers(0, len(line) - 1))
        if kind == "insert":
            line[at:at] = draw(st.sampled_from(PIECES))
        elif kind == "delete":
            del line[at : at + draw(st.integers(1, 8))]
        elif kind == "replace":
            line[at] = draw(st.integers(0x20, 0x7E))
        elif kind == "retype":
            text = bytes(line)
            start = text.find(b'": "', at)
            end = text.find(b'"', start + 4) if start >= 0 else -1
            if end >= 0:
                line[start + 3 : end + 1] = draw(st.sampled_from((b"5", b"[]", b"{}", b"null")))
        else:
            line += draw(st.sampled_from(PIECES))
        if not line:
            line = bytearray(b"x")
    return bytes(line)


def _answered_without_fault(response: httpx.Response) -> dict[str, Any] | None:
    """The file object of a 200, None for a 400 (with its error object checked)."""
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        body: dict[str, Any] = response.json()
        return body
    api_error(response, 400)
    return None


def _upload(client: httpx.Client, content: bytes, cut: int, *, reversed_parts: bool) -> httpx.Response:
    created = client.post(
        "/v1/uploads",
        json={"bytes": len(content), "filename": "in.jsonl", "mime_type": "text/jsonl", "purpose": "batch"},
    )
    assert created.status_code == 200, created.text
    upload_id = created.json()["id"]
    parts = []
    for data in (content[:cut], content[cut:]):
        added = client.post(f"/v1/uploads/{upload_id}/parts", files={"data": ("blob", data)})
        assert added.status_code == 200, added.text
        parts.append(added.json()["id"])
    if reversed_parts:
        parts.reverse()
    return client.post(f"/v1/uploads/{upload_id}/complete", json={"part_ids": parts})


@settings(max_examples=examples(60))
@given(line=mutated_line(), cut=st.integers(1, 10_000), reversed_parts=st.booleans())
def test_a_mutated_line_is_answered_as_the_lines_problem_on_both_ways_in(
    api: httpx.Client, line: bytes, cut: int, reversed_parts: bool
) -> None:
    content = jsonl(chat_line("first")) + line + b"\n" + jsonl(chat_line("last"))
    direct = _answered_without_fault(post_file(api, content))
    cut = min(cut, len(content) - 1)
    uploaded = _answered_without_fault(_upload(api, content, cut, reversed_parts=reversed_parts))
    if not reversed_parts:  # the same bytes: the same verdict
        assert (direct is None) == (uploaded is None)
        if direct is not None and uploaded is not None:
            assert uploaded["file"]["bytes"] == direct["bytes"]


@settings(max_examples=examples(40))
@given(
    field=st.sampled_from(("custom_id", "method", "url", "body")),
    wrong=st.sampled_from(("5", "[]", "{}", "null", "true", '"x"')),
    trailing=st.sampled_from((b"x", b"}", b"]", b",", b" 5", b'"')),
)
def test_a_field_of_the_wrong_type_before_broken_json_is_not_valid_json(
    api: httpx.Client, field: str, wrong: str, trailing: bytes
) -> None:
    """The typed decoder meets the field's type first and the broken end after: the line is still
    reported as not JSON, on line 2, whichever field and whatever follows."""
    line = chat_line("second")
    text = json.dumps({**line, field: "__wrong__"}).replace('"__wrong__"', wrong).encode() + trailing
    error = api_error(post_file(api, jsonl(chat_line("first")) + text + b"\n"), 400)
    assert error["code"] == "invalid_batch_file"
    assert "line 2" in error["message"] and "not valid JSON" in error["message"], error
