"""The retry decision, as pure functions: what is retried, how long to wait, `Retry-After`.

Nothing here does I/O. After each response the clients ask `should_retry` and `next_delay`; after
a connection error or timeout, `should_retry_error` and `error_delay`. Then they call the policy's
`sleep` (or `async_sleep`) hook, which tests replace so nothing sleeps.

The schedule is the user guide's: 5 retries, waiting 1, 2, 4, 8, 16 s (doubling, capped at 60 s),
or exactly what the server's `Retry-After` header says when it sends one. Connection errors and
timeouts follow the same schedule with jitter added (by default up to half of each delay), so that
many clients cut off by one server restart do not all come back at the same instant.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

__all__ = [
    "RETRY_AFTER",
    "RetryPolicy",
    "backoff_delay",
    "error_delay",
    "is_retryable",
    "is_retryable_error",
    "next_delay",
    "parse_retry_after",
    "should_retry",
    "should_retry_error",
]

RETRY_AFTER = "Retry-After"

_DELAY_SECONDS = re.compile(r"\d+(\.\d+)?")

_RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
"""Transport errors worth another try: timeouts, refused or broken connections, and a server that
closed the connection without answering. Not retried: invalid URLs, proxy or TLS setup errors."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the clients retry a request that got a retryable status, a connection error or a timeout.

    `max_retries` counts retries, not attempts: with 5, a request is sent at most 6 times.
    The n-th retry waits `base_delay * multiplier ** (n - 1)` seconds, capped at `max_delay`,
    plus up to `jitter` times that (a fraction; 0 means none, the guide's exact schedule) — unless
    the response carries `Retry-After`, whose value is used as is.

    With `retry_connection_errors` (the default), a request that got no answer at all (refused
    or reset connection, timeout) is retried on the same schedule, with `connection_jitter` in
    place of `jitter`. Set it False to fail at once instead.

    `sleep` and `async_sleep` are how the clients wait, between retries and between the polls of
    `wait_for_batch`; tests pass recorders so no time passes. `async_sleep` defaults to
    `asyncio.sleep`; under trio pass `trio.sleep`.
    """

    max_retries: int = 5
    base_delay: float = 1.0
    multiplier: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.0
    retry_statuses: frozenset[int] = frozenset({429, 503})
    retry_connection_errors: bool = True
    connection_jitter: float = 0.5
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)
    async_sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, not {self.max_retries}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("base_delay and max_delay must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, not {self.multiplier}")
        if self.jitter < 0 or self.connection_jitter < 0:
            raise ValueError("jitter and connection_jitter must be >= 0")


def is_retryable(policy: RetryPolicy, status_code: int) -> bool:
    """Whether a response with this status may be retried at all (429 and 503 by default)."""
    return status_code in policy.retry_statuses


def should_retry(policy: RetryPolicy, status_code: int, attempt: int) -> bool:
    """Whether to retry after `attempt` (1-based) was answered with `status_code`."""
    return is_retryable(policy, status_code) and attempt <= policy.max_retries


def is_retryable_error(policy: RetryPolicy, error: BaseException) -> bool:
    """Whether a request that raised this httpx error (it got no response) may be retried."""
    return policy.retry_connection_errors and isinstance(error, _RETRYABLE_ERRORS)


def should_retry_error(policy: RetryPolicy, error: BaseException, attempt: int) -> bool:
    """Whether to retry after `attempt` (1-based) raised `error` instead of getting a response."""
    return is_retryable_error(policy, error) and attempt <= policy.max_retries


def backoff_delay(
    policy: RetryPolicy,
    attempt: int,
    *,
    jitter: float | None = None,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before retry number `attempt` (1-based) when the server gave no Retry-After.

    1, 2, 4, 8, 16, 32, 60, 60, … with the default policy. Jitter (`policy.jitter` unless given)
    adds a random fraction, at most `jitter`, of the delay; the result never exceeds `max_delay`.
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, not {attempt}")
    try:
        raw = policy.base_delay * policy.multiplier ** (attempt - 1)
    except OverflowError:  # a huge attempt number: the cap applies anyway
        raw = policy.max_delay if policy.base_delay else 0.0
    delay = min(raw, policy.max_delay)
    if jitter is None:
        jitter = policy.jitter
    if jitter:
        delay = min(delay * (1 + jitter * rand()), policy.max_delay)
    return delay


def error_delay(policy: RetryPolicy, attempt: int, *, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number `attempt` after a connection error or timeout:
    the backoff schedule with `policy.connection_jitter`."""
    return backoff_delay(policy, attempt, jitter=policy.connection_jitter, rand=rand)


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait according to a `Retry-After` header value, or None if it is absent or invalid.

    Accepts delay-seconds (`"30"`; a decimal such as `"1.5"` is tolerated) or an HTTP date
    (`"Wed, 21 Oct 2015 07:28:00 GMT"`), which is measured from `now` (default: the current
    time). A date in the past means 0. Naive datetimes are taken as UTC.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if _DELAY_SECONDS.fullmatch(text):
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if now is None:
        now = datetime.now(UTC)
    elif now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


def next_delay(
    policy: RetryPolicy,
    attempt: int,
    response_headers: Mapping[str, str],
    *,
    now: datetime | None = None,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before retry number `attempt` (1-based).

    A valid `Retry-After` in `response_headers` (matched case-insensitively) wins over the
    backoff schedule; otherwise `backoff_delay`.
    """
    retry_after = parse_retry_after(_header(response_headers, RETRY_AFTER), now)
    if retry_after is not None:
        return retry_after
    return backoff_delay(policy, attempt, rand=rand)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    lowered = name.lower()
    for key, candidate in headers.items():
        if key.lower() == lowered:
            return candidate
    return None
