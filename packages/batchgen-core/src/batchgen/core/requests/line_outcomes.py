"""Whether a result line records a completed request or a failed one: the rule every count uses.

A line of a batch's output or error file is a **failure** when it carries an ``error``, has no
``response``, or its response's ``status_code`` is 400 or more; any other line is a
**completion**. Where the line is kept does not decide it: under the user guide's convention the
error lines sit in the output file beside the results, and only OpenAI's keeps them apart.

Every count of a batch's requests goes by this one rule, however the batch runs: one process
counts each line as it is written (``execution.executor``) and again from its files after a
restart (``storage.result_files``); replicas sharing a batch count the lines of each commit
(``work.shard_runner``, summed by the ledger). The merged view of a batch and its retries ranks
lines by it too (``batches.result_merge``), so ``request_counts.failed`` is exactly how many
lines a retry of the failed ones takes.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

__all__ = ["LineOutcome", "line_outcome", "outcome"]

#: A response's ``status_code`` from which on it reports a failure (an HTTP client error).
FIRST_FAILED_STATUS = 400


class LineOutcome(enum.Enum):
    """What one result line says became of its request."""

    COMPLETED = "completed"
    FAILED = "failed"


class _Response(msgspec.Struct):
    status_code: int = 200


class _ResultLine(msgspec.Struct):
    response: _Response | None = None
    error: Any = None


_read_line = msgspec.json.Decoder(_ResultLine).decode


def outcome(status_code: int | None, error: object) -> LineOutcome:
    """The outcome of a line whose response has ``status_code`` (None: the line has no response)
    and whose ``error`` is as given (None: no error)."""
    if error is not None or status_code is None or status_code >= FIRST_FAILED_STATUS:
        return LineOutcome.FAILED
    return LineOutcome.COMPLETED


def line_outcome(line: bytes) -> LineOutcome:
    """The outcome a result line (its JSON bytes) records; ``msgspec.DecodeError`` when it is
    not a result line."""
    parsed = _read_line(line)
    status_code = None if parsed.response is None else parsed.response.status_code
    return outcome(status_code, parsed.error)
