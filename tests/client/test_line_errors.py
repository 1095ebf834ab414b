"""Which failed lines `--retry-failed` retries, and how the client words its counts.

A line whose error code says the request itself is at fault (`context_length_exceeded`,
`invalid_request`, ...) is never a reason to retry; any other code is. The tally of a batch's
merged results does not depend on how the bytes arrive. Counts are worded `1 retry`, `2 retries`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.client._line_errors import PERMANENT_ERROR_CODES, LineTally, failure_code, is_retryable_failure
from batchgen.client._requests import RequestSpec, error_from_response
from batchgen.client._retries import RetryRounds
from batchgen.client._wording import count_of
from tests.examples import examples

#: Codes the server writes for failures of the moment.
TRANSIENT_CODES = ("backend_error", "upstream_error", "internal_error", "model_unavailable", "server_error")
_codes = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=30)


@settings(max_examples=examples(200))
@given(code=st.sampled_from(sorted(PERMANENT_ERROR_CODES)), status=st.none() | st.integers(400, 599))
def test_a_permanent_code_is_never_retryable(code: str, status: int | None) -> None:
    assert not is_retryable_failure(code, status)


@settings(max_examples=examples(200))
@given(
    code=st.sampled_from(TRANSIENT_CODES) | _codes.filter(lambda code: code not in PERMANENT_ERROR_CODES),
    status=st.none() | st.integers(400, 599),
)
def test_any_other_code_is_retryable(code: str, status: int | None) -> None:
    assert is_retryable_failure(code, status)


@settings(max_examples=examples(200))
@given(status=st.integers(400, 599))
def test_a_failure_without_a_code_is_judged_by_its_status(status: int) -> None:
    assert is_retryable_failure(None, status) is (status >= 500 or status in (408, 429))


def test_the_code_is_read_from_an_error_line_and_from_a_failed_response() -> None:
    assert failure_code({"response": {"status_code": 200, "body": {}}, "error": None}) is None
    error_line = {"response": None, "error": {"code": "context_length_exceeded", "message": "long"}}
    assert failure_code(error_line) == ("context_length_exceeded", None)
    refused = {"response": {"status_code": 400, "body": {"error": {"code": "invalid_value"}}}, "error": None}
    assert failure_code(refused) == ("invalid_value", 400)
    assert failure_code({"response": {"status_code": 503, "body": "busy"}, "error": None}) == (None, 503)


def _line(index: int, code: str | None) -> bytes:
    if code is None:
        record: dict[str, Any] = {"custom_id": f"r{index}", "response": {"status_code": 200, "body": {}}}
        record["error"] = None
    else:
        record = {"custom_id": f"r{index}", "response": None, "error": {"code": code, "message": "no"}}
    return json.dumps(record).encode() + b"\n"


@settings(max_examples=examples(150))
@given(
    codes=st.lists(
        st.none() | st.sampled_from([*sorted(PERMANENT_ERROR_CODES), *TRANSIENT_CODES]), max_size=40
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_the_tally_counts_each_failure_by_code_however_the_bytes_arrive(
    codes: list[str | None], cuts: list[int]
) -> None:
    content = b"".join(_line(index, code) for index, code in enumerate(codes))
    tally = LineTally()
    start = 0
    for cut in sorted(min(cut, len(content)) for cut in cuts):
        tally.feed(content[start:cut])
        start = cut
    tally.feed(content[start:].removesuffix(b"\n"))  # the last line may come without its newline
    tally.finish()
    failed = [code for code in codes if code is not None]
    assert tally.lines == len(codes)
    assert dict(tally.permanent) == _count([code for code in failed if code in PERMANENT_ERROR_CODES])
    assert dict(tally.retryable) == _count([code for code in failed if code not in PERMANENT_ERROR_CODES])


def _count(codes: list[str]) -> dict[str, int]:
    return {code: codes.count(code) for code in set(codes)}


def _rounds(total: int | None) -> RetryRounds:
    return RetryRounds("batch_a", 5, None, None, False, None, total=total)


@settings(max_examples=examples(200))
@given(
    permanent=st.integers(0, 5),
    retryable=st.integers(0, 5),
    successes=st.integers(0, 5),
    never_ran=st.integers(0, 5),
)
def test_a_round_retries_only_what_a_retry_may_fix(
    permanent: int, retryable: int, successes: int, never_ran: int
) -> None:
    tally = LineTally()
    for index, code in enumerate(
        ["context_length_exceeded"] * permanent + ["backend_error"] * retryable + [None] * successes
    ):
        tally.add(_line(index, code))
    spec = _rounds(permanent + retryable + successes + never_ran).retry(tally)
    wanted = (["failed"] if retryable else []) + (["not_run"] if never_ran else [])
    if not wanted:
        assert spec is None  # only failures no retry can fix are left, or nothing at all
    else:
        assert spec is not None and spec.json == {"outcomes": wanted}


@settings(max_examples=examples(200))
@given(count=st.integers(0, 10**7))
def test_a_count_takes_the_noun_that_goes_with_it(count: int) -> None:
    retries = count_of(count, "retry", "retries")
    assert retries == f"{count:,} retry" if count == 1 else retries == f"{count:,} retries"
    assert count_of(count, "byte").endswith(" byte" if count == 1 else " bytes")


@settings(max_examples=examples(50))
@given(attempts=st.integers(1, 12))
def test_a_request_that_ran_out_of_retries_says_so_grammatically(attempts: int) -> None:
    request = httpx.Request("GET", "http://server/v1/batches/batch_a")
    response = httpx.Response(503, json={"error": {"message": "busy"}}, request=request)
    error = error_from_response(
        RequestSpec("GET", "/v1/batches/batch_a"), response, attempts=attempts, exhausted=True
    )
    attempt_words = "attempt" if attempts == 1 else "attempts"
    retry_words = "retry" if attempts - 1 == 1 else "retries"
    assert f"after {attempts} {attempt_words} ({attempts - 1} {retry_words})" in str(error)
