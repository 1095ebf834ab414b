"""The batch input file format: validating an uploaded JSONL file and indexing its lines.

Validation reads the file once, line by line, checks each line against the request schema
(``request_schema``, the same code that reads a line when it runs) and the server's models, and
reports the first problems by 1-based line number. Indexing records where each request line starts and how long it is, so the intake pool can
queue requests as (offset, length) pairs and read a body only when its request is admitted.
Blank lines are ignored by both.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection

import attrs

from batchgen.core.errors import InvalidBatchFile, InvalidRequest, LineProblem
from batchgen.core.request_schema import Envelope, read_body, read_envelope

#: How many problems a validation error lists before summarising the rest.
MAX_REPORTED_PROBLEMS = 10


@attrs.frozen
class BatchFileSummary:
    """What validation learned about a valid batch input file."""

    line_count: int
    url: str


@attrs.frozen
class LineIndex:
    """Byte offset and length of every request line in a file, in file order."""

    offsets: array  # array("q")
    lengths: array  # array("l")

    def __len__(self) -> int:
        return len(self.offsets)


def _check_line(raw: bytes, served_models: Collection[str] | None) -> Envelope:
    """The line's envelope once the request schema accepts the whole line; InvalidRequest otherwise."""
    envelope = read_envelope(raw)
    body = read_body(envelope)
    if served_models is not None and body.model is not None and body.model not in served_models:
        raise InvalidRequest(
            f"'body.model' {body.model!r} is not served here; use one of {', '.join(map(repr, served_models))}",
            param="body.model",
        )
    return envelope


def validate_batch_file(path: str, served_models: Collection[str] | None = None) -> BatchFileSummary:
    """Check every line of the file at ``path``; raise InvalidBatchFile listing the problems.

    With ``served_models``, a line's ``body.model`` must be absent or one of them.
    """
    problems: list[LineProblem] = []
    total_problems = 0
    seen_ids: set[str] = set()
    file_url: str | None = None
    count = 0

    def report(line_number: int, message: str) -> None:
        nonlocal total_problems
        total_problems += 1
        if len(problems) < MAX_REPORTED_PROBLEMS:
            problems.append(LineProblem(line_number, message))

    with open(path, "rb") as stream:
        for line_number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            count += 1
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                report(line_number, "not valid UTF-8")
                continue
            try:
                envelope = _check_line(raw, served_models)
            except InvalidRequest as exc:
                report(line_number, exc.message)
                continue
            custom_id = envelope.custom_id
            if custom_id in seen_ids:
                report(line_number, f"duplicate custom_id {custom_id!r}")
                continue
            seen_ids.add(custom_id)
            if file_url is None:
                file_url = envelope.url
            elif envelope.url != file_url:
                report(
                    line_number,
                    f"'url' {envelope.url!r} differs from {file_url!r}; a file must use one url",
                )
    if count == 0:
        raise InvalidBatchFile([LineProblem(1, "the file contains no requests")])
    if problems:
        raise InvalidBatchFile(problems, total_problems)
    assert file_url is not None
    return BatchFileSummary(line_count=count, url=file_url)


def index_batch_file(path: str) -> LineIndex:
    """Record the offset and length of every non-blank line of the file at ``path``."""
    offsets = array("q")
    lengths = array("l")
    position = 0
    with open(path, "rb") as stream:
        for raw in stream:
            if raw.strip():
                offsets.append(position)
                lengths.append(len(raw))
            position += len(raw)
    return LineIndex(offsets, lengths)
