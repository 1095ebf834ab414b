"""The request schema and the range rules: what a line may hold, and that the batch level and a
line's body refuse exactly the same sampling values."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.batches.options import check_parameters
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import BatchParameters
from batchgen.core.requests.json_bounds import MAX_DEPTH, bounds_problem
from batchgen.core.requests.schema import (
    Body,
    ChatBody,
    CompletionBody,
    message_dicts,
    read_body,
    read_envelope,
)
from tests.helpers import chat_line, completion_line


def _read(line: Any) -> Body:
    return read_body(read_envelope(json.dumps(line).encode()))


def _refusal(line: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        _read(line)
    return caught.value


@pytest.mark.parametrize(
    ("line", "param", "words"),
    [
        (completion_line("a", "x", messages=5), "body.messages", "belongs to /v1/chat/completions"),
        (chat_line("a", prompt="x"), "body.prompt", "belongs to /v1/completions"),
        (
            chat_line("a", [{"type": "text", "text": 5}]),
            "body.messages[0].content[0].text",
            "must be a string",
        ),
        (chat_line("a", [{"type": "text"}]), "body.messages[0].content[0]", "text part needs a string"),
        (chat_line("a", [{"text": "hi"}]), "body.messages[0].content[0].type", "missing"),
        (chat_line("a", 7), "body.messages[0].content", "must be a string or a list or null"),
        (chat_line("a", messages=[{"content": "hi"}]), "body.messages[0].role", "missing"),
        (
            chat_line("a", messages=[{"role": "robot", "content": "hi"}]),
            "body.messages[0].role",
            "must be one of",
        ),
        (chat_line("a", messages=[]), "body.messages", "non-empty list"),
        (chat_line("a", max_tokens=0), "body.max_tokens", "at least 1"),
        (chat_line("a", max_completion_tokens=1.5), "body.max_completion_tokens", "an integer"),
        (chat_line("a", stop=[1]), "body.stop[0]", "must be a string"),
        (chat_line("a", stop=["a", "b", "c", "d", "e"]), "body.stop", "at most 4"),
        (chat_line("a", temperature=-1), "body.temperature", "between 0 and 2"),
        (chat_line("a", top_p=2), "body.top_p", "in (0, 1]"),
        (chat_line("a", top_k=-5), "body.top_k", "-1 or at least 1"),
        (chat_line("a", seed="x"), "body.seed", "an integer"),
        (chat_line("a", n=0), "body.n", "from 1 to 128"),
        (chat_line("a", stream=True), "body.stream", "do not stream"),
        ({**completion_line("a", "x"), "body": {"prompt": ["x"]}}, "body.prompt", "must be a string"),
        ({**chat_line("a"), "body": []}, "body", "must be a JSON object"),
        ({**chat_line("a"), "custom_id": ""}, "custom_id", "non-empty"),
    ],
)
def test_a_malformed_line_is_refused_naming_the_field(line: Any, param: str, words: str) -> None:
    refusal = _refusal(line)
    assert refusal.param == param
    assert words in refusal.message and param in refusal.message


def test_unknown_fields_are_allowed_and_messages_keep_every_field() -> None:
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}],
        "name": "ann",
    }
    line = chat_line("a", messages=[message], logprobs=True, user={"any": [1, 2]}, stop="END")
    line["extra"] = {"nested": [None]}
    envelope = read_envelope(json.dumps(line).encode())
    body = read_body(envelope)
    assert isinstance(body, ChatBody) and body.stop == "END"
    assert message_dicts(envelope) == (message,)


def test_a_completions_body_reads_its_prompt() -> None:
    body = _read(completion_line("a", "Once", max_tokens=3, top_k=-1, seed=-(2**63)))
    assert isinstance(body, CompletionBody) and (body.prompt, body.max_tokens) == ("Once", 3)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        (_nested(MAX_DEPTH - 3), False),  # the line, body and user object add three levels
        (_nested(MAX_DEPTH - 2), True),
        (2**63 - 1, False),
        (2**63, True),
        (-(2**63) - 1, True),
        ("[" * 500 + "9" * 30, False),  # inside a string, neither bound applies
        (1.5e300, False),
    ],
)
def test_nesting_and_integer_bounds(value: Any, refused: bool) -> None:
    raw = json.dumps(chat_line("a", user={"v": value})).encode()
    assert (bounds_problem(raw) is not None) == refused
    if refused:
        with pytest.raises(InvalidRequest):
            read_envelope(raw)


def test_a_line_nested_far_too_deep_is_refused_not_a_recursion_error() -> None:
    raw = b'{"custom_id": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InvalidRequest, match="nested deeper than 64"):
        read_envelope(raw)


#: Each batch-level parameter and the names the same limit has in a line's body.
_LEVELS = {
    "max_decoding_length": ("max_tokens", "max_completion_tokens"),
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
}
_edges = st.sampled_from([-2, -1, 0, 1, 2, 3, 40]) | st.sampled_from(
    [-0.0001, 0.0, 0.0001, 0.5, 1.0, 1.0001, 1.9999, 2.0, 2.0001]
)


@given(
    name=st.sampled_from(sorted(_LEVELS)), value=_edges | st.integers(-(2**63), 2**63 - 1) | st.floats(-3, 3)
)
def test_the_batch_level_and_a_line_refuse_the_same_values(name: str, value: float) -> None:
    try:
        fields: dict[str, Any] = {name: value}
        check_parameters(BatchParameters(**fields))
        batch_accepts = True
    except InvalidRequest as exc:
        batch_accepts = False
        assert exc.param == name
    for body_name in _LEVELS[name]:
        try:
            _read(chat_line("a", **{body_name: value}))
            line_accepts = True
        except InvalidRequest as exc:
            line_accepts = False
            assert exc.param == f"body.{body_name}"
        assert line_accepts == batch_accepts, (name, body_name, value)
