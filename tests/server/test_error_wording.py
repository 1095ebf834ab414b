"""Errors say what is wrong in the words of the API the client used, and with OpenAI's codes.

- a ``/v1/responses`` line is told about ``max_output_tokens``, ``text.format`` and
  ``top_logprobs``, never the chat fields it runs through;
- a bad ``\\u`` escape (a lone surrogate, fewer than four hex digits) is named, with its byte;
- a batch larger than the whole intake pool is told it can never fit, not to retry;
- a bad ``endpoint`` is ``invalid_value``; a bad metadata value names ``metadata.<key>``.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.models import CHAT_COMPLETIONS, RESPONSES
from batchgen.core.requests.results import error_line
from tests.examples import examples
from tests.helpers import (
    ApiFactory,
    api_error,
    chat_line,
    jsonl,
    post_batch,
    post_file,
    upload,
    wait_for_status,
)

_FUZZ = settings(
    max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
#: What only a chat line's errors may name.
_CHAT_FIELDS = ("body.max_completion_tokens", "body.response_format", "'body.logprobs':", "body.messages")


def _responses_line(**body: object) -> dict[str, object]:
    return {"custom_id": "r", "method": "POST", "url": RESPONSES, "body": {"input": "Hi", **body}}


def _upload_problem(api: httpx.Client, line: dict[str, object]) -> str:
    error = api_error(post_file(api, jsonl(line)), 400)
    assert error["code"] == "invalid_batch_file"
    return str(error["message"])


@given(
    value=st.integers(max_value=0)
    | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
)
@_FUZZ
def test_a_bad_max_output_tokens_is_named_as_such(api: httpx.Client, value: object) -> None:
    message = _upload_problem(api, _responses_line(max_output_tokens=value))
    assert "body.max_output_tokens" in message, message
    assert not any(field in message for field in _CHAT_FIELDS), message


@given(
    text=st.sampled_from(
        [
            {"format": {"type": "json_schema"}},
            {"format": {"type": "json_schema", "json_schema": {}}},
            {"format": {"type": "xml"}},
            {"format": "json"},
            "json",
            {"format": ["json_object"]},
            {"format": {"type": "json_schema", "name": "x", "schema": 5}},
        ]
    )
)
@_FUZZ
def test_a_bad_text_format_is_named_as_such(api: httpx.Client, text: object) -> None:
    message = _upload_problem(api, _responses_line(text=text))
    assert "body.text" in message, message
    assert not any(field in message for field in _CHAT_FIELDS), message


@pytest.mark.parametrize(
    ("field", "value", "instead"),
    [
        ("max_tokens", 5, "max_output_tokens"),
        ("max_completion_tokens", 5, "max_output_tokens"),
        ("response_format", {"type": "json_object"}, "text.format"),
    ],
)
def test_chat_fields_in_a_responses_body_are_refused_naming_the_responses_field(
    api: httpx.Client, field: str, value: object, instead: str
) -> None:
    message = _upload_problem(api, _responses_line(**{field: value}))
    assert f"'body.{field}'" in message and instead in message, message


def test_a_feature_the_model_lacks_names_the_responses_field(api: httpx.Client) -> None:
    """The simulated backend gives no logprobs: a Responses line asks for them by top_logprobs."""
    message = _upload_problem(api, _responses_line(top_logprobs=2))
    assert "'body.top_logprobs'" in message and "'body.logprobs'" not in message, message


@pytest.mark.parametrize(
    "message",
    [
        "'body.response_format' could not be compiled into a grammar: bad",
        "'body.max_completion_tokens' must be at least 1",
        "'body.logprobs': model 'm' (x backend) does not support logprobs",
    ],
)
def test_run_time_error_lines_of_responses_name_responses_fields(message: str) -> None:
    written = json.loads(error_line("c", "invalid_request", message, RESPONSES))["error"]["message"]
    assert not any(field in written for field in _CHAT_FIELDS), written
    assert (
        json.loads(error_line("c", "invalid_request", message, CHAT_COMPLETIONS))["error"]["message"]
        == message
    )


# --- escapes --------------------------------------------------------------------------------

_lone = st.one_of(
    st.integers(0xD800, 0xDBFF).map(lambda unit: (f"\\u{unit:04x}", "lone surrogate")),  # no low after
    st.integers(0xDC00, 0xDFFF).map(lambda unit: (f"\\u{unit:04X}", "lone surrogate")),
    st.text("0123456789abcdefABCDEF", max_size=3).map(lambda digits: (f"\\u{digits}", "invalid \\u escape")),
)


@given(
    escape=_lone,
    where=st.sampled_from(["custom_id", "content", "model", "extra"]),
    tail=st.sampled_from(["", "x", " "]),
)
@_FUZZ
def test_a_bad_unicode_escape_is_named_with_its_byte(
    api: httpx.Client, escape: tuple[str, str], where: str, tail: str
) -> None:
    text, kind = escape
    marker = "\x00MARK\x00"
    line = chat_line("c", "Hi")
    if where == "custom_id":
        line["custom_id"] = marker
    elif where == "content":
        line["body"]["messages"][0]["content"] = marker
    elif where == "model":
        line["body"]["model"] = marker
    else:
        line["extra"] = marker
    raw = json.dumps(line).replace(json.dumps(marker)[1:-1], text + tail).encode()
    error = api_error(post_file(api, raw + b"\n"), 400)
    message = str(error["message"])
    assert kind in message, message
    assert "hex escape" not in message and "truncated" not in message, message
    position = int(re.search(r"at byte (\d+)", message).group(1))  # type: ignore[union-attr]
    assert raw[position : position + len(text)] == text.encode()


def test_a_lone_surrogate_in_a_create_body_is_named(api: httpx.Client) -> None:
    raw = b'{"input_file_id": "file-x\\ud800", "endpoint": "/v1/chat/completions"}'
    message = str(api_error(api.post("/v1/batches", content=raw), 400)["message"])
    assert "lone surrogate '\\ud800' at byte 25" in message, message


def test_escaped_backslashes_and_good_pairs_are_fine(api: httpx.Client) -> None:
    raw = jsonl(chat_line("c", "a \\u not an escape \U0001f600 and \\\\ud800 text"))
    assert "\\\\u" in raw.decode() and "\\ud83d\\ude00" in raw.decode()
    assert post_file(api, raw).status_code == 200


# --- capacity, endpoint, metadata ---------------------------------------------------------------


@given(size=st.integers(4, 12))
@settings(
    max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_batch_that_can_never_fit_is_told_so(api_factory: ApiFactory, size: int) -> None:
    client = api_factory("--max-intake-capacity", "3", storage=f"s{size}")
    file_id = upload(client, jsonl(*[chat_line(f"r{i}") for i in range(size)]))["id"]
    batch = post_batch(client, file_id).json()
    failed = wait_for_status(client, batch["id"], {"failed"})
    message = failed["errors"]["data"][0]["message"]
    assert failed["errors"]["data"][0]["code"] == "capacity_exceeded"
    assert "never fit" in message and "Retry later" not in message, message
    assert str(size) in message and "3" in message and "split" in message, message


@given(
    endpoint=st.text(max_size=20).filter(lambda text: not text.startswith("/v1/"))
    | st.just("/v1/audio/speech")
)
@_FUZZ
def test_a_bad_endpoint_is_invalid_value(api: httpx.Client, endpoint: str) -> None:
    file_id = "file-none"
    error = api_error(post_batch(api, file_id, endpoint=endpoint), 400)
    assert error["code"] == "invalid_value" and error["param"] == "endpoint", error


@given(
    key=st.text(min_size=1, max_size=64),
    value=st.integers() | st.none() | st.booleans() | st.lists(st.text(), max_size=2) | st.text(min_size=513),
)
@_FUZZ
def test_a_bad_metadata_value_names_its_key(api: httpx.Client, key: str, value: object) -> None:
    error = api_error(post_batch(api, "file-none", metadata={key: value}), 400)
    assert error["param"] == f"metadata.{key}", error
