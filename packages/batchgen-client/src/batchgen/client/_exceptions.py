"""The exceptions batchgen.client raises; every one is a `BatchGenClientError`, hence a RuntimeError.

    BatchGenClientError (RuntimeError)
    ├── APIConnectionError          the request got no HTTP answer (connect, read, protocol), even
    │   │                           after the retries the policy allows
    │   └── APITimeoutError         … because a timeout elapsed (also a TimeoutError)
    ├── APIStatusError              the server answered with an error status; carries its error body
    │   └── RetriesExhausted        … a retryable status (429, 503) persisted through every retry
    ├── BatchFailed                 wait_for_batch(raise_on_failure=True) saw failed/expired/cancelled
    └── BatchWaitTimeout            wait_for_batch's own timeout passed first (also a TimeoutError)

httpx's transport errors are translated into `APIConnectionError`/`APITimeoutError` at the edge,
in the clients' send path; the httpx exception is kept as `__cause__`.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "BatchFailed",
    "BatchGenClientError",
    "BatchWaitTimeout",
    "RetriesExhausted",
]


class BatchGenClientError(RuntimeError):
    """Base class of every error raised by batchgen.client."""


class APIConnectionError(BatchGenClientError):
    """The request got no HTTP response: the server is unreachable or the connection broke.

    `attempts` is how many times the request was sent (1 when it was not retried).
    """

    def __init__(self, message: str, *, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


class APITimeoutError(APIConnectionError, TimeoutError):
    """A connect, read, write or pool timeout elapsed."""


class APIStatusError(BatchGenClientError):
    """The server answered with an error status.

    `body` is the decoded JSON body (or the text, if it was not JSON). For the server's
    OpenAI-shaped errors, `{"error": {"message", "type", "param", "code"}}`, the four fields are
    also available as `message`, `error_type`, `param` and `code`. For an uploaded batch file the
    server refused (`code` `invalid_batch_file`), `line_problems` lists its message's problems,
    one `"line N: ..."` string each (several for one line that has several), and the summary of
    those not listed (`"and 12 more"`) last; it is empty for other errors.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        body: object = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.response = response
        error = _error_object(body)
        self.error: dict[str, Any] = error
        self.message: str | None = _str_or_none(error.get("message"))
        self.error_type: str | None = _str_or_none(error.get("type"))
        self.param: str | None = _str_or_none(error.get("param"))
        self.code: str | None = _str_or_none(error.get("code"))
        self.line_problems: list[str] = (
            _line_problems(self.message) if self.code == "invalid_batch_file" and self.message else []
        )


class RetriesExhausted(APIStatusError):
    """A retryable status (429 or 503 by default) was still returned after every retry."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        attempts: int,
        body: object = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, body=body, response=response)
        self.attempts = attempts


class BatchFailed(BatchGenClientError):
    """A batch waited for ended `failed`, `expired` or `cancelled`; `batch` is its final object."""

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch
        self.batch_id: str | None = _str_or_none(batch.get("id"))
        self.status: str | None = _str_or_none(batch.get("status"))
        detail = batch_error_summary(batch)
        message = f"batch {self.batch_id} ended {self.status}"
        super().__init__(f"{message}: {detail}" if detail else message)


class BatchWaitTimeout(BatchGenClientError, TimeoutError):
    """`wait_for_batch` gave up after its timeout; `batch` is the last object seen (still running)."""

    def __init__(self, batch_id: str, timeout: float, batch: dict[str, Any]) -> None:
        super().__init__(f"batch {batch_id} still {batch.get('status')!s} after waiting {timeout:g} s")
        self.batch_id = batch_id
        self.timeout = timeout
        self.batch = batch


def batch_error_summary(batch: dict[str, Any]) -> str:
    """A one-line account of why a batch failed, from OpenAI's `errors.data` and an `error` field.

    The server reports one failure in both, so each distinct message is said once.
    """
    messages: list[str] = []
    errors = batch.get("errors")
    if isinstance(errors, dict) and isinstance(errors.get("data"), list):
        for item in errors["data"]:
            if isinstance(item, dict):
                messages.append(_describe(item))
    error = batch.get("error")
    if isinstance(error, dict):
        messages.append(_describe(error))
    elif isinstance(error, str) and error:
        messages.append(error)
    return "; ".join(dict.fromkeys(m for m in messages if m))


def _describe(error: dict[str, Any]) -> str:
    code, message = error.get("code"), error.get("message")
    if code and message:
        return f"{code}: {message}"
    return str(message or code or "")


_FILE_PREFIX = "Invalid batch input file: "
_NEXT_LINE = re.compile(r"; (?=line \d+: )")
_MORE = re.compile(r" \((and \d+ more)\)$")


def _line_problems(message: str) -> list[str]:
    """The problems of an `invalid_batch_file` message: `"line N: ..."` each, then `"and N more"`."""
    if not message.startswith(_FILE_PREFIX):
        return []
    text = message[len(_FILE_PREFIX) :]
    more = _MORE.search(text)
    if more is not None:
        text = text[: more.start()]
    problems = _NEXT_LINE.split(text)
    return problems + ([more[1]] if more is not None else [])


def _error_object(body: object) -> dict[str, Any]:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return error
    return {}


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
