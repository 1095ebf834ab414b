"""The batch input file format: validating an uploaded JSONL file and indexing its lines.

Validation reads the file once, in blocks of whole lines, checks each line against the request
schema (``request_schema``, the same code that reads a line when it runs) and the server's models,
and reports the first problems by 1-based line number. Indexing records where each request line starts and how long it is, so the intake pool can
queue requests as (offset, length) pairs and read a body only when its request is admitted.
Blank lines are ignored by both.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterator
from typing import BinaryIO, Protocol, runtime_checkable

import attrs
import msgspec

from batchgen.core.errors import InvalidBatchFile, InvalidRequest, LineProblem
from batchgen.core.json_bounds import lines_within_bounds
from batchgen.core.request_schema import Body, Envelope, check_body, line_decoder, read_body, read_envelope

#: How many problems a validation error lists before summarising the rest.
MAX_REPORTED_PROBLEMS = 10
#: Bytes of the file validation reads and checks at a time.
VALIDATION_BLOCK_BYTES = 1 << 20


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
    validation = _Validation(served_models)
    with open(path, "rb") as stream:
        for first_line_number, block in _blocks(stream, VALIDATION_BLOCK_BYTES):
            validation.check_block(first_line_number, block)
    if validation.count == 0:
        raise InvalidBatchFile([LineProblem(1, "the file contains no requests")])
    if validation.problems:
        raise InvalidBatchFile(validation.problems, validation.total_problems)
    assert validation.file_url is not None
    return BatchFileSummary(line_count=validation.count, url=validation.file_url)


def _blocks(stream: BinaryIO, size: int) -> Iterator[tuple[int, bytes]]:
    """The file in blocks of whole lines (about ``size`` bytes, or one longer line), each with the
    1-based number of its first line; only the last block may end without a newline."""
    line_number = 1
    carry = b""
    while chunk := stream.read(size):
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        if not cut:  # inside a line longer than a block
            carry = data
            continue
        block, carry = data[:cut], data[cut:]
        yield line_number, block
        line_number += block.count(b"\n")
    if carry:
        yield line_number, carry


class _Validation:
    """What validation has found so far, line by line.

    A block whose bytes are valid UTF-8 and within the JSON bounds (``lines_within_bounds``) is
    checked the fast way: each line decoded whole with one decoder (``line_decoder``) and its
    remaining rules checked on the result (with a ``LineRouter``, its ``check_line`` too, and the
    model it gives must be the file's). A line that fails any of that, every line of an endpoint
    with no whole-line decoder, and every line of any other block, is checked the exact way
    (``check_line``), which says what is wrong.
    """

    def __init__(self, served_models: Collection[str] | LineRouter | None) -> None:
        self.served_models = served_models
        self.router: LineRouter | None = None
        self.served_names: Collection[str] | None = None
        if isinstance(served_models, LineRouter):
            self.router = served_models
        else:
            self.served_names = served_models
        self.problems: list[LineProblem] = []
        self.total_problems = 0
        self.seen_ids: set[str] = set()
        self.file_url: str | None = None
        self.file_model: object = None
        self.count = 0

    def report(self, line_number: int, message: str) -> None:
        self.total_problems += 1
        if len(self.problems) < MAX_REPORTED_PROBLEMS:
            self.problems.append(LineProblem(line_number, message))

    def check_block(self, first_line_number: int, block: bytes) -> None:
        lines = block.split(b"\n")
        if not lines[-1]:
            lines.pop()  # the block ends with a newline
        fast = _valid_utf8(block) and lines_within_bounds(block)
        served, router, seen = self.served_names, self.router, self.seen_ids
        for line_number, raw in enumerate(lines, start=first_line_number):
            url = self.file_url
            if not fast or url is None or (decoder := line_decoder(url)) is None:
                self.check_line(line_number, raw)
                continue
            try:
                line = decoder.decode(raw)
                accepted = (
                    bool(line.custom_id)
                    and line.method == "POST"
                    and line.url == url
                    and line.custom_id not in seen
                    and check_body(line.body) is not None
                    and (served is None or line.body.model is None or line.body.model in served)
                    and (router is None or router.check_line(url, line.body) is self.file_model)
                )
            except (msgspec.MsgspecError, InvalidRequest):
                accepted = False
            if accepted:
                self.count += 1
                seen.add(line.custom_id)
            else:  # blank, or wrong somewhere: the exact way says which
                self.check_line(line_number, raw)

    def check_line(self, line_number: int, raw: bytes) -> None:
        """Check one line the exact way, reporting what is wrong with it."""
        if not raw.strip():
            return
        self.count += 1
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            self.report(line_number, "not valid UTF-8")
            return
        try:
            envelope, model = _check_line(raw, self.served_models)
        except InvalidRequest as exc:
            self.report(line_number, exc.message)
            return
        if self.file_model is None:
            self.file_model = model
        elif model is not self.file_model:
            self.report(
                line_number,
                f"'body.model' {read_body(envelope).model!r} is another model than the lines before; "
                "a batch file's lines must all use one model (as in OpenAI's Batch API)",
            )
            return
        custom_id = envelope.custom_id
        if custom_id in self.seen_ids:
            self.report(line_number, f"duplicate custom_id {custom_id!r}")
            return
        self.seen_ids.add(custom_id)
        if self.file_url is None:
            self.file_url = envelope.url
        elif envelope.url != self.file_url:
            self.report(
                line_number,
                f"'url' {envelope.url!r} differs from {self.file_url!r}; a file must use one url",
            )


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


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
