"""The retry decision of batchgen.client: backoff schedule, Retry-After parsing, which statuses."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta, timezone

import httpx
import pytest

from batchgen.client import RetryPolicy
from batchgen.client._retry import (
    backoff_delay,
    error_delay,
    is_retryable,
    is_retryable_error,
    next_delay,
    parse_retry_after,
    should_retry,
    should_retry_error,
)

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def test_default_policy_is_the_guides() -> None:
    policy = RetryPolicy()
    assert policy.max_retries == 5
    assert policy.base_delay == 1.0
    assert policy.max_delay == 60.0
    assert policy.jitter == 0.0
    assert policy.retry_statuses == frozenset({429, 503})
    assert policy.retry_connection_errors is True
    assert policy.connection_jitter == 0.5


def test_policy_is_frozen() -> None:
    policy = RetryPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_retries = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retries": -1},
        {"base_delay": -1.0},
        {"multiplier": 0.5},
        {"jitter": -0.1},
        {"connection_jitter": -0.1},
    ],
)
def test_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_backoff_schedule_doubles_from_one_second() -> None:
    policy = RetryPolicy()
    assert [backoff_delay(policy, n) for n in range(1, 6)] == [1, 2, 4, 8, 16]


def test_backoff_is_capped_at_sixty_seconds() -> None:
    policy = RetryPolicy()
    assert backoff_delay(policy, 6) == 32
    assert backoff_delay(policy, 7) == 60  # 64 capped
    assert backoff_delay(policy, 50) == 60
    assert backoff_delay(policy, 10_000) == 60  # no OverflowError


def test_backoff_follows_a_custom_policy() -> None:
    policy = RetryPolicy(base_delay=0.5, multiplier=3, max_delay=10)
    assert [backoff_delay(policy, n) for n in range(1, 5)] == [0.5, 1.5, 4.5, 10]


def test_backoff_attempt_is_one_based() -> None:
    with pytest.raises(ValueError):
        backoff_delay(RetryPolicy(), 0)


def test_jitter_is_off_by_default() -> None:
    # rand would add the whole delay again if jitter were applied
    assert backoff_delay(RetryPolicy(), 3, rand=lambda: 1.0) == 4


def test_jitter_adds_at_most_its_fraction_and_respects_the_cap() -> None:
    policy = RetryPolicy(jitter=0.5)
    assert backoff_delay(policy, 1, rand=lambda: 0.0) == 1.0
    assert backoff_delay(policy, 1, rand=lambda: 1.0) == 1.5
    assert backoff_delay(policy, 3, rand=lambda: 0.5) == 5.0
    assert backoff_delay(policy, 6, rand=lambda: 1.0) == 48.0
    assert backoff_delay(policy, 7, rand=lambda: 1.0) == 60.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("30", 30.0), ("0", 0.0), (" 7 ", 7.0), ("1.5", 1.5), ("120", 120.0)],
)
def test_retry_after_seconds(value: str, expected: float) -> None:
    assert parse_retry_after(value, NOW) == expected


def test_retry_after_http_date_is_measured_from_now() -> None:
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:45 GMT", NOW) == 45.0


def test_retry_after_http_date_with_offset_and_naive_now() -> None:
    later = (NOW + timedelta(seconds=90)).astimezone(timezone(timedelta(hours=2)))
    value = later.strftime("%a, %d %b %Y %H:%M:%S +0200")
    assert parse_retry_after(value, NOW.replace(tzinfo=None)) == 90.0


def test_retry_after_date_in_the_past_means_now() -> None:
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", NOW) == 0.0


def test_retry_after_date_defaults_to_the_current_time() -> None:
    soon = datetime.now(UTC) + timedelta(seconds=100)
    delay = parse_retry_after(soon.strftime("%a, %d %b %Y %H:%M:%S GMT"))
    assert delay is not None
    assert 97 <= delay <= 100


@pytest.mark.parametrize("value", [None, "", "soon", "-5", "inf", "nan", "1e3", "30s"])
def test_retry_after_invalid_is_none(value: str | None) -> None:
    assert parse_retry_after(value, NOW) is None


def test_next_delay_prefers_retry_after_seconds() -> None:
    policy = RetryPolicy()
    assert next_delay(policy, 1, {"Retry-After": "30"}) == 30.0
    assert next_delay(policy, 5, {"Retry-After": "3"}) == 3.0


def test_next_delay_retry_after_is_case_insensitive_in_a_plain_dict() -> None:
    assert next_delay(RetryPolicy(), 1, {"retry-after": "12"}) == 12.0


def test_next_delay_prefers_retry_after_http_date() -> None:
    headers = {"Retry-After": "Wed, 01 Jan 2025 12:00:20 GMT"}
    assert next_delay(RetryPolicy(), 4, headers, now=NOW) == 20.0


def test_next_delay_uses_retry_after_verbatim_without_cap_or_jitter() -> None:
    policy = RetryPolicy(jitter=1.0, max_delay=60)
    assert next_delay(policy, 1, {"Retry-After": "90"}, rand=lambda: 1.0) == 90.0


def test_next_delay_falls_back_to_backoff() -> None:
    policy = RetryPolicy()
    assert [next_delay(policy, n, {}) for n in range(1, 8)] == [1, 2, 4, 8, 16, 32, 60]
    assert next_delay(policy, 3, {"Retry-After": "garbage"}) == 4


@pytest.mark.parametrize(("status", "expected"), [(429, True), (503, True)])
def test_retryable_statuses(status: int, expected: bool) -> None:
    assert is_retryable(RetryPolicy(), status) is expected


@pytest.mark.parametrize("status", [200, 400, 404, 409, 413, 500, 502])
def test_other_statuses_are_not_retried(status: int) -> None:
    assert not is_retryable(RetryPolicy(), status)


def test_custom_retry_statuses() -> None:
    policy = RetryPolicy(retry_statuses=frozenset({502}))
    assert is_retryable(policy, 502)
    assert not is_retryable(policy, 429)


def test_should_retry_allows_five_retries() -> None:
    policy = RetryPolicy()
    assert [should_retry(policy, 429, attempt) for attempt in range(1, 8)] == [
        True,
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert not should_retry(policy, 400, 1)
    assert not should_retry(RetryPolicy(max_retries=0), 503, 1)


# --- connection errors and timeouts ----------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("slow"),
        httpx.ReadTimeout("slow"),
        httpx.WriteTimeout("slow"),
        httpx.PoolTimeout("busy"),
        httpx.ReadError("reset"),
        httpx.WriteError("broken pipe"),
        httpx.RemoteProtocolError("server disconnected without sending a response"),
    ],
)
def test_connection_errors_and_timeouts_are_retryable(error: Exception) -> None:
    assert is_retryable_error(RetryPolicy(), error)
    assert not is_retryable_error(RetryPolicy(retry_connection_errors=False), error)


@pytest.mark.parametrize(
    "error",
    [httpx.UnsupportedProtocol("ftp"), httpx.LocalProtocolError("bad header"), httpx.ProxyError("no")],
)
def test_errors_retrying_cannot_fix(error: Exception) -> None:
    assert not is_retryable_error(RetryPolicy(), error)


def test_should_retry_error_allows_five_retries() -> None:
    error = httpx.ConnectError("refused")
    assert [should_retry_error(RetryPolicy(), error, n) for n in range(1, 8)] == [True] * 5 + [False] * 2


def test_error_delay_is_the_schedule_with_connection_jitter() -> None:
    policy = RetryPolicy()
    assert [error_delay(policy, n, rand=lambda: 0.0) for n in range(1, 6)] == [1, 2, 4, 8, 16]
    assert [error_delay(policy, n, rand=lambda: 1.0) for n in range(1, 6)] == [1.5, 3, 6, 12, 24]
    assert error_delay(policy, 6, rand=lambda: 1.0) == 48
    assert error_delay(policy, 7, rand=lambda: 1.0) == 60  # the cap holds with jitter
    assert error_delay(RetryPolicy(connection_jitter=0), 3, rand=lambda: 1.0) == 4


def test_status_retries_keep_the_exact_schedule_by_default() -> None:
    assert backoff_delay(RetryPolicy(), 3, rand=lambda: 1.0) == 4
    assert backoff_delay(RetryPolicy(), 3, jitter=0.25, rand=lambda: 1.0) == 5
