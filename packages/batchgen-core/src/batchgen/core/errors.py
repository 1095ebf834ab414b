"""The exceptions BatchService raises, each carrying what a caller needs to report it.

    BatchGenError
     ├── NotFound            (also LookupError)  an unknown file or batch id
     ├── InvalidRequest      (also ValueError)   a malformed argument; ``param`` names it
     │    └── InvalidBatchFile                    a batch input file with line-numbered problems
     ├── Conflict                                 the operation clashes with current state
     ├── PayloadTooLarge     (also ValueError)   an upload over the size limit
     ├── IntakeFull                               the intake pool cannot take the batch now
     ├── ServiceUnavailable                       the backend or service is not able to serve
     └── StorageUnavailable                       storage refused a write or read (full disk, I/O
                                                  error, read-only folder); nothing was changed

The server maps each class to one HTTP status; the service never raises HTTP errors itself.

``CannotStart`` is apart: the service cannot start as configured (a backend's engine missing, a
replica whose database and blob store belong to different clusters). Its message is the
paragraph the command prints instead of a traceback.
"""

from __future__ import annotations

import attrs


class CannotStart(Exception):
    """The service cannot start as it is configured; the message says why and what to change."""


class BatchGenError(Exception):
    """Base class of every error BatchService raises on purpose."""

    code: str = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(BatchGenError, LookupError):
    """``code`` replaces the class's code where OpenAI's is more specific (``model_not_found``)."""

    code = "not_found"

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(BatchGenError, ValueError):
    """``param`` names the argument; ``code`` replaces the class's code where OpenAI's is more
    specific (``invalid_value``: a value outside the ones the argument takes)."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


@attrs.frozen
class LineProblem:
    """One problem found in one line of a batch input file (1-based line number).

    A line with several problems has one ``LineProblem`` each, in the order of its fields;
    ``left_out`` (on the last one listed for a line) counts that line's problems not listed.
    """

    line: int
    message: str
    left_out: int = 0

    def __str__(self) -> str:
        text = f"line {self.line}: {self.message}"
        if self.left_out:
            text += f"; line {self.line}: ... and {self.left_out} more problems on this line"
        return text


class InvalidBatchFile(InvalidRequest):
    """A batch input file failed validation; ``problems`` lists the first few, by line.

    ``total_problems`` counts every problem found, those listed, those left out of a listed line
    (``LineProblem.left_out``) and those of lines not listed."""

    code = "invalid_batch_file"

    def __init__(self, problems: list[LineProblem], total_problems: int | None = None) -> None:
        accounted = len(problems) + sum(problem.left_out for problem in problems)
        total = total_problems if total_problems is not None else accounted
        shown = "; ".join(str(p) for p in problems)
        more = f" (and {total - accounted} more)" if total > accounted else ""
        super().__init__(f"Invalid batch input file: {shown}{more}", param="file")
        self.problems = problems
        self.total_problems = total


class Conflict(BatchGenError):
    code = "conflict"


class PayloadTooLarge(BatchGenError, ValueError):
    code = "file_too_large"


class IntakeFull(BatchGenError):
    """The intake pool has no room for the batch now; retry after ``retry_after_s``."""

    code = "capacity_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(BatchGenError):
    code = "service_unavailable"

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StorageUnavailable(BatchGenError):
    """Storage refused the call (a full disk, an I/O error, a read-only folder); nothing was made.

    ``disk_full`` tells a full disk (or quota) from other faults; either way the call may be
    retried after ``retry_after_s``, once the fault is gone.
    """

    def __init__(self, message: str, *, disk_full: bool, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.disk_full = disk_full
        self.retry_after_s = retry_after_s
        self.code = "insufficient_storage" if disk_full else "storage_unavailable"
