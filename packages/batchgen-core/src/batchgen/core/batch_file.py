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
from typing import Protocol, runtime_checkable

import attrs

from batchgen.core.errors import InvalidBatchFile, InvalidRequest, LineProblem
from batchgen.core.request_schema import Body, Envelope, read_body, read_envelope

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


@runtime_checkable
class LineRouter(Protocol):
    """Checks that a line can run on the model it names (``served_models.ModelSet``)."""

    def check_line(self, url: str, body: Body) -> object:
        """The model the line runs on (any object, compared by identity); InvalidRequest if it
        cannot run there."""
        ...


def _check_line(raw: bytes, served_models: Collection[str] | LineRouter | None) -> tuple[Envelope, object]:
    """The line's envelope and model once the request schema and the model accept the whole line;
    InvalidRequest otherwise."""
    envelope = read_envelope(raw)
    body = read_body(envelope)
    if isinstance(served_models, LineRouter):
        return envelope, served_models.check_line(envelope.url, body)
    if served_models is not None and body.model is not None and body.model not in served_models:
        raise InvalidRequest(
            f"'body.model' {body.model!r} is not served here; use one of {', '.join(map(repr, served_models))}",
            param="body.model",
        )
    return envelope, None


def validate_batch_file(
    path: str, served_models: Collection[str] | LineRouter | None = None
) -> BatchFileSummary:
    """Check every line of the file at ``path``; raise InvalidBatchFile listing the problems.

    With ``served_models`` names, a line's ``body.model`` must be absent or one of them. With a
    ``LineRouter`` (the service's models), each line must be able to run on the model it names
    (that model serves its endpoint and the features it uses), and all lines must run on one
    model, as in OpenAI's Batch API.
    """
    problems: list[LineProblem] = []
    total_problems = 0
    seen_ids: set[str] = set()
    file_url: str | None = None
    file_model: object = None
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
                envelope, model = _check_line(raw, served_models)
            except InvalidRequest as exc:
                report(line_number, exc.message)
                continue
            if file_model is None:
                file_model = model
            elif model is not file_model:
                report(
                    line_number,
                    f"'body.model' {read_body(envelope).model!r} is another model than the lines before; "
                    "a batch file's lines must all use one model (as in OpenAI's Batch API)",
                )
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


def first_line_model(path: str) -> str | None:
    """The ``body.model`` of the file's first request line (validation made every line run on
    the same model); None when it names none or cannot be read."""
    with open(path, "rb") as stream:
        for raw in stream:
            if raw.strip():
                try:
                    return read_body(read_envelope(raw)).model
                except InvalidRequest:
                    return None
    return None


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
