"""A line with several problems has every one of them reported, bounded, in the order of its fields.

Hypothesis builds a chat line with k independent problems drawn from a set of kinds (a bad
envelope field, a body field out of range or of the wrong type, a message whose role is of the
wrong type, not one of OpenAI's roles or missing, a content part without its text, ...) and checks that validation lists
exactly min(k, MAX_LINE_PROBLEMS) of them for that line, each naming its field, in the line's
field order, and counts the rest (``... and N more problems on this line``); a file of many such
lines lists the first ``MAX_REPORTED_LINES`` of them and counts every problem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.errors import InvalidBatchFile
from batchgen.core.files.batch_file import MAX_LINE_PROBLEMS, MAX_REPORTED_LINES, validate_batch_file
from batchgen.core.requests.schema import line_problems
from tests.examples import examples

MESSAGES = 30
#: Each problem kind: where it sorts in the line (its top-level field, then its body field and
#: message), the field its message names, and how it breaks the line.
_ENVELOPE = ("custom_id", "method", "url", "body")
_BODY_FIELDS = (
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "logit_bias",
    "frequency_penalty",
    "prompt",
)
_BODY_BREAKS: dict[str, Any] = {
    "max_tokens": 0,
    "temperature": 9,
    "top_p": 3,
    "top_k": -5,
    "seed": "x",  # the wrong type
    "stop": "x" * 5000,
    "n": 0,
    "stream": True,
    "logit_bias": {"12": 500},
    "frequency_penalty": [1],  # the wrong type
    "prompt": "belongs to completions",
}
KINDS = (
    [("envelope", "custom_id"), ("envelope", "method")]
    + [("body", name) for name in _BODY_BREAKS]
    + [("role", str(index)) for index in range(MESSAGES)]
    + [("no-role", str(index)) for index in range(MESSAGES)]
    + [("no-text", str(index)) for index in range(MESSAGES)]
)


def _build(kinds: list[tuple[str, str]]) -> tuple[dict[str, Any], list[str]]:
    """The line with the problems ``kinds`` and the field each reported problem names, in order."""
    chosen = set(kinds)
    messages: list[dict[str, Any]] = []
    message_params: list[str] = []
    for index in range(MESSAGES):
        message: dict[str, Any] = {"role": "user", "content": "hi"}
        path = f"body.messages[{index}]"
        if ("no-text", str(index)) in chosen:
            message["content"] = [{"type": "text"}]
            message_params.append(f"{path}.content[0]")
        if ("role", str(index)) in chosen and ("no-role", str(index)) not in chosen:
            role = 5 if index % 2 else "robot"  # of the wrong type, or not a role
            message = {"role": role, **{k: v for k, v in message.items() if k != "role"}}
            message_params.insert(len(message_params) - (("no-text", str(index)) in chosen), f"{path}.role")
        elif ("no-role", str(index)) in chosen:
            del message["role"]
            message_params.append(f"{path}.role")  # a missing field comes after the fields there
        messages.append(message)
    body: dict[str, Any] = {}
    params: list[str] = []
    for name in _BODY_FIELDS:
        if name == "messages":
            body["messages"] = messages
            params += message_params
        elif ("body", name) in chosen:
            body[name] = _BODY_BREAKS[name]
            params.append(f"body.{name}")
    line = {
        "custom_id": "" if ("envelope", "custom_id") in chosen else "a",
        "method": "GET" if ("envelope", "method") in chosen else "POST",
        "url": "/v1/chat/completions",
        "body": body,
    }
    envelope = [name for name in ("custom_id", "method") if ("envelope", name) in chosen]
    return line, envelope + params


def _deduplicated(kinds: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A message's role may be of the wrong type or missing, not both: one problem."""
    missing = {index for kind, index in kinds if kind == "no-role"}
    return [(kind, index) for kind, index in kinds if not (kind == "role" and index in missing)]


@settings(max_examples=examples(150), deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=len(KINDS), unique=True))
def test_every_problem_of_a_line_is_reported_up_to_the_bound(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[tuple[str, str]]
) -> None:
    kinds = _deduplicated(kinds)
    line, params = _build(kinds)
    k = len(params)
    assert k == len(kinds)
    raw = json.dumps(line).encode()
    assert [problem.param for problem in line_problems(raw).problems] == params
    path = tmp_path_factory.mktemp("lines") / "in.jsonl"
    path.write_bytes(raw + b"\n")
    with pytest.raises(InvalidBatchFile) as raised:
        validate_batch_file(str(path))
    error = raised.value
    shown = min(k, MAX_LINE_PROBLEMS)
    assert [problem.line for problem in error.problems] == [1] * shown
    for problem, param in zip(error.problems, params, strict=False):
        assert param in problem.message
    assert error.problems[-1].left_out == k - shown
    assert error.total_problems == k
    assert (f"line 1: ... and {k - shown} more problems on this line" in str(error)) == (k > shown)
    assert "(and " not in str(error)


@settings(max_examples=examples(20), deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=len(KINDS), unique=True),
    lines=st.integers(1, 2 * MAX_REPORTED_LINES),
)
def test_a_file_lists_its_first_lines_with_problems_and_counts_every_problem(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[tuple[str, str]], lines: int
) -> None:
    line, params = _build(_deduplicated(kinds))
    k = len(params)
    path = tmp_path_factory.mktemp("lines") / "in.jsonl"
    path.write_bytes(
        b"".join(
            json.dumps({**line, "custom_id": line["custom_id"] and f"r{i}"}).encode() + b"\n"
            for i in range(lines)
        )
    )
    with pytest.raises(InvalidBatchFile) as raised:
        validate_batch_file(str(path))
    error = raised.value
    listed = min(lines, MAX_REPORTED_LINES)
    assert sorted({problem.line for problem in error.problems}) == list(range(1, listed + 1))
    assert len(error.problems) == listed * min(k, MAX_LINE_PROBLEMS)
    assert error.total_problems == lines * k
    assert ("(and " in str(error)) == (lines > listed)
    if lines > listed:
        assert str(error).endswith(f"(and {(lines - listed) * k} more)")


def test_a_line_of_good_fields_has_no_problem(tmp_path: Path) -> None:
    line, params = _build([])
    assert params == [] and line_problems(json.dumps(line).encode()).problems == ()
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(line).encode() + b"\n")
    assert validate_batch_file(str(path)).line_count == 1
