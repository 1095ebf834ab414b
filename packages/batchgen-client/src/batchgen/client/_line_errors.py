"""Which failed result lines a retry may fix, decided from their error code, and the tally of a
batch's merged results that `submit_batch(..., retry_failed=N)` and `batchgen submit
--retry-failed` judge by.

A request fails for good when the request itself is at fault: it is malformed, its prompt is
longer than the model's context, it names a model the server does not serve, its content is
refused. Running it again gives the same error, so those codes (`PERMANENT_ERROR_CODES`, the one
list) are never retried. Every other code is a failure of the moment (`backend_error` after the
server's own attempts, `upstream_error`, `internal_error`, `model_unavailable`, timeouts, rate
limits) and is retried. A failed line with no code is judged by its HTTP status: 408, 429 and 5xx
are retryable, any other 4xx is not.

No I/O here: feed `LineTally` the bytes of the merged results as they arrive.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PERMANENT_ERROR_CODES", "LineTally", "failure_code", "is_retryable_failure"]

PERMANENT_ERROR_CODES = frozenset(
    {
        "invalid_request",  # a malformed line or body, a parameter out of bounds
        "invalid_request_error",  # OpenAI's type, used as a code by some upstreams
        "invalid_value",
        "invalid_type",
        "unsupported_value",
        "validation_error",
        "context_length_exceeded",  # the prompt is longer than the model's context
        "string_above_max_length",
        "model_not_found",  # the line names a model the server does not serve
        "content_filter",
        "content_policy_violation",
    }
)
"""Error codes that no retry can fix: the request itself is at fault."""

#: HTTP statuses of a failed line without a code that a retry may fix.
_RETRYABLE_STATUSES = frozenset({408, 429})


def is_retryable_failure(code: str | None, status_code: int | None = None) -> bool:
    """Whether a failed line with this error `code` (and HTTP `status_code`, for a line whose
    error has no code) may succeed when run again."""
    if code:
        return code not in PERMANENT_ERROR_CODES
    if status_code is None:
        return True
    return status_code >= 500 or status_code in _RETRYABLE_STATUSES


def failure_code(line: Mapping[str, Any]) -> tuple[str | None, int | None] | None:
    """(error code, HTTP status) of a failed result line, or None for a success: an `error`
    object, or a `response` whose `status_code` is 400 or more (its body's `error.code`)."""
    error = line.get("error")
    if isinstance(error, Mapping):
        code = error.get("code")
        return (code if isinstance(code, str) else None), None
    response = line.get("response")
    if not isinstance(response, Mapping):
        return None, None  # neither a response nor an error: not a success either
    status = response.get("status_code")
    if not isinstance(status, int) or status < 400:
        return None
    body = response.get("body")
    inner = body.get("error") if isinstance(body, Mapping) else None
    code = inner.get("code") if isinstance(inner, Mapping) else None
    return (code if isinstance(code, str) else None), status


@dataclass(slots=True)
class LineTally:
    """What the lines of a batch's results say: how many, and its failures by code, retryable or
    not. Feed it the bytes as they arrive (`feed`), then call `finish`."""

    lines: int = 0
    retryable: Counter[str] = field(default_factory=Counter)
    """Failures a retry may fix, by code (`"HTTP 503"` for one without a code)."""
    permanent: Counter[str] = field(default_factory=Counter)
    """Failures no retry can fix, by code."""
    _pending: bytearray = field(default_factory=bytearray, repr=False)

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        end = self._pending.rfind(b"\n")
        if end < 0:
            return
        complete = bytes(self._pending[: end + 1])
        del self._pending[: end + 1]
        for raw in complete.splitlines():
            self.add(raw)

    def finish(self) -> LineTally:
        """Count a last line without its newline; returns the tally."""
        if self._pending:
            self.add(bytes(self._pending))
            self._pending.clear()
        return self

    def add(self, raw: bytes) -> None:
        """Count one result line (blank ones are skipped, unreadable ones count as retryable)."""
        if not raw.strip():
            return
        self.lines += 1
        try:
            line = json.loads(raw)
        except ValueError:
            line = None
        failure = failure_code(line) if isinstance(line, dict) else (None, None)
        if failure is None:
            return
        code, status = failure
        label = code or (f"HTTP {status}" if status is not None else "no error code")
        if is_retryable_failure(code, status):
            self.retryable[label] += 1
        else:
            self.permanent[label] += 1

    @property
    def failed(self) -> int:
        return self.retryable.total() + self.permanent.total()
