"""Every number a client sends is bounded where it is parsed: out of range, negative, fractional,
or written in other digits (``int()`` takes Arabic-Indic and fullwidth ones), it is a 400 naming the parameter,
never a 500, and never taken as a number.

The numbers come in as text (``completion_window``, the ``expires_after[seconds]`` form field,
query parameters, the ``Range`` and ``Content-Length`` headers) or as JSON numbers (the create
body's ``output_expires_after.seconds`` and batch-level sampling values, a line's body fields).
Hypothesis drives each through the in-process server.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.helpers import CHAT, api_error, chat_line, jsonl, post_batch, post_file, upload

#: Decimal digits of other scripts, which ``int()`` and ``str.isdigit()`` accept (Arabic-Indic,
#: Extended Arabic-Indic, Devanagari, fullwidth), and digit-like characters ``isdigit()``
#: accepts but ``int()`` refuses (superscripts, circled digits).
_OTHER_DIGITS = "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u06f0\u06f1\u06f2\u06f3\u06f4\u06f5\u06f6\u06f7\u06f8\u06f9\u0966\u0967\u0968\u0969\u096a\u096b\u096c\u096d\u096e\u096f\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19\u00b2\u00b3\u00b9\u2460"
_digit_text = st.text(alphabet="0123456789" + _OTHER_DIGITS, min_size=1, max_size=30)
_number_text = (
    _digit_text
    | st.integers().map(str)
    | st.integers(min_value=10**15, max_value=10**40).map(str)
    | st.floats(allow_nan=True, allow_infinity=True).map(str)
    | st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), max_size=12)
    | st.sampled_from(
        ["-1", "0", "1e3", " 7", "0x10", "1_000", "+5", "\u0663\u0666\u0660\u0660", "\uff11\uff10"]
    )
)
_json_number = (
    st.integers()
    | st.integers(min_value=2**62, max_value=2**66)
    | st.integers(max_value=-(2**62))
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.text(alphabet="0123456789" + _OTHER_DIGITS, max_size=8)
)
_FUZZ = settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _only_ascii_digits(text: str) -> bool:
    return text.isascii() and text.strip().isdigit()


def _refused_naming(response: httpx.Response, param: str) -> None:
    error = api_error(response, 400)
    assert error["param"] == param or (error["param"] or "").startswith(param), error


@pytest.fixture(scope="module")
def input_file(api: httpx.Client) -> str:
    return str(upload(api, jsonl(chat_line("a")))["id"])


@given(amount=_number_text, unit=st.sampled_from(["s", "m", "h", "d", "", "H", "w"]))
@_FUZZ
def test_completion_window_is_a_400_unless_ascii_digits_within_a_year(
    api: httpx.Client, input_file: str, amount: str, unit: str
) -> None:
    window = amount + unit
    response = post_batch(api, input_file, completion_window=window)
    seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(unit)
    acceptable = (
        seconds is not None
        and amount.isascii()
        and amount.isdigit()
        and not amount.startswith("0")
        and int(amount) * seconds <= 365 * 86400
    )
    if acceptable:
        assert response.status_code == 200, response.text
        api.post(f"/v1/batches/{response.json()['id']}/cancel")
    else:
        _refused_naming(response, "completion_window")


@pytest.mark.parametrize("window", ["106751991167301d", "9223372036854775807s", "1" * 5000 + "h", "366d"])
def test_the_reported_completion_windows_are_400s(api: httpx.Client, input_file: str, window: str) -> None:
    _refused_naming(post_batch(api, input_file, completion_window=window), "completion_window")


@given(seconds=_number_text)
@_FUZZ
def test_expires_after_seconds_takes_only_ascii_digits(api: httpx.Client, seconds: str) -> None:
    response = api.post(
        "/v1/files",
        files={"file": ("in.jsonl", jsonl(chat_line("a")))},
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": seconds},
    )
    if _only_ascii_digits(seconds) and 1 <= int(seconds) <= 30 * 86400:
        assert response.status_code == 200, response.text
    else:
        _refused_naming(response, "expires_after")


@pytest.mark.parametrize(
    "seconds",
    [
        "\u0661\u0660\u0660\u0660",
        "\u0663\u0666\u0660\u0660",
        "\uff13\uff16\uff10\uff10",
        "\u00b2",
        "3600\u00b2",
        "\u2460",
    ],
)
def test_expires_after_in_other_digits_is_refused(api: httpx.Client, seconds: str) -> None:
    response = api.post(
        "/v1/files",
        files={"file": ("in.jsonl", jsonl(chat_line("a")))},
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": seconds},
    )
    _refused_naming(response, "expires_after")


@given(limit=_number_text, path=st.sampled_from(["/v1/files", "/v1/batches"]))
@_FUZZ
def test_list_limits_are_bounded(api: httpx.Client, limit: str, path: str) -> None:
    response = api.get(path, params={"limit": limit})
    most = 10000 if path == "/v1/files" else 100
    if response.status_code == 200:
        # the query decoder takes an integral number in any ASCII spelling ("7", "7.0", "7e0")
        assert limit.isascii() and 1 <= float(limit) <= most and float(limit).is_integer(), limit
    else:
        _refused_naming(response, "limit")
        assert limit.isascii() or response.status_code == 400


@given(value=_json_number)
@_FUZZ
def test_output_expires_after_seconds_is_bounded(api: httpx.Client, input_file: str, value: object) -> None:
    response = post_batch(api, input_file, output_expires_after={"anchor": "created_at", "seconds": value})
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and 1 <= value <= 30 * 86400:  # type: ignore[operator]
        assert response.status_code == 200, response.text
        api.post(f"/v1/batches/{response.json()['id']}/cancel")
    else:
        assert response.status_code == 400, response.text
        assert str(api_error(response, 400)["param"]).startswith("output_expires_after")


@given(name=st.sampled_from(["max_decoding_length", "temperature", "top_p", "top_k"]), value=_json_number)
@_FUZZ
def test_batch_level_numbers_never_500(api: httpx.Client, input_file: str, name: str, value: object) -> None:
    response = api.post("/v1/batches", json={"input_file_id": input_file, "endpoint": CHAT, name: value})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        api.post(f"/v1/batches/{response.json()['id']}/cancel")
    else:
        assert api_error(response, 400)["param"] == name


#: Every number a line's body holds that the server reads, by endpoint.
_LINE_NUMBERS = [
    ("/v1/chat/completions", name)
    for name in ("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "temperature", "top_p")
] + [
    ("/v1/completions", "logprobs"),
    ("/v1/completions", "max_tokens"),
    ("/v1/responses", "max_output_tokens"),
    ("/v1/responses", "top_logprobs"),
    ("/v1/responses", "temperature"),
    ("/v1/embeddings", "dimensions"),
]
_INPUTS: dict[str, dict[str, object]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"prompt": "Hi"},
    "/v1/responses": {"input": "Hi"},
    "/v1/embeddings": {"input": "Hi"},
}


@given(field=st.sampled_from(_LINE_NUMBERS), value=_json_number)
@_FUZZ
def test_line_numbers_are_refused_at_upload_naming_the_field(
    api: httpx.Client, field: tuple[str, str], value: object
) -> None:
    url, name = field
    line = {"custom_id": "x", "method": "POST", "url": url, "body": {**_INPUTS[url], name: value}}
    response = post_file(api, jsonl(line))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = api_error(response, 400)
        assert error["code"] == "invalid_batch_file"
        if f"'body.{name}'" not in error["message"]:  # the simulated model's only problem: value fine
            assert "does not serve /v1/embeddings" in error["message"], error
            assert isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**63


@given(first=_digit_text | st.just(""), last=_digit_text | st.just(""))
@_FUZZ
def test_range_headers_never_500(api: httpx.Client, input_file: str, first: str, last: str) -> None:
    header = f"bytes={first}-{last}".encode()  # non-ASCII digits as their UTF-8 bytes
    response = api.get(f"/v1/files/{input_file}/content", headers=[(b"range", header)])
    assert response.status_code in (200, 206, 416), response.text
    if not (first + last).isascii():
        assert response.status_code == 200, "a range in other digits is ignored as malformed"
