"""The batch input file format: validating an uploaded JSONL file and indexing its lines.

Validation reads the file once, in blocks of whole lines, checks each line against the request
schema (``requests.schema``, the same code that reads a line when it runs) and the server's models,
and reports every problem of the first lines with problems by 1-based line number (those of the
schema and of the model checks together, in the line's field order; bounded:
``MAX_REPORTED_LINES`` lines, ``MAX_LINE_PROBLEMS`` problems each, the rest counted). Lines are accepted a few hundred at a time
where they can be (``_Validation``): each line's rules are judged once per shape of body, since a
line then costs about a microsecond. Indexing records where each request line starts and how long it is, so the intake pool can
queue requests as (offset, length) pairs and read a body only when its request is admitted, and
its prompt prefix key (``prefix_keys``), so the pool can admit the lines of one prefix together.
Blank lines are ignored by both.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable, Collection, Iterator
from typing import Any, BinaryIO, Protocol, runtime_checkable

import attrs
import msgspec

from batchgen.core.errors import InvalidBatchFile, InvalidRequest, LineProblem
from batchgen.core.models import RESPONSES
from batchgen.core.requests.json_bounds import lines_within_bounds
from batchgen.core.requests.prefix_keys import line_prefix_key
from batchgen.core.requests.responses_api import responses_terms
from batchgen.core.requests.schema import (
    Body,
    block_reader,
    check_body,
    in_field_order,
    line_decoder,
    line_problems,
    read_body,
    read_envelope,
)

#: How many lines with problems a validation error lists before counting the rest, and how many
#: problems of one line (a line's problems are all found, as a compiler finds a file's).
MAX_REPORTED_LINES = 10
MAX_LINE_PROBLEMS = 20
#: Bytes of the file validation reads and checks at a time.
VALIDATION_BLOCK_BYTES = 1 << 20
#: Lines validation tries to accept at once (``_Validation.accept_at_once``): few enough that the
#: objects decoding them makes are freed before they set off a garbage collection (the first
#: generation's threshold is 700 container objects), many enough to share the per-group work.
AT_ONCE_LINES = 256
#: The most shapes of a group judged for the first time: past it the rest of the block is checked
#: line by line. And the most shapes one validation remembers.
MAX_NEW_SHAPES = 16
MAX_SHAPES = 4096


@attrs.frozen
class BatchFileSummary:
    """What validation learned about a valid batch input file."""

    line_count: int
    url: str


@attrs.frozen
class LineIndex:
    """Byte offset and length of every request line in a file, in file order; and, when known,
    each line's prompt prefix key (``prefix_keys``), by which the intake pool admits the lines of
    one prefix together."""

    offsets: array  # array("q")
    lengths: array  # array("l")
    prefixes: array | None = None  # array("q"), or None: no line has a prefix (embeddings)

    def __len__(self) -> int:
        return len(self.offsets)


@runtime_checkable
class LineRouter(Protocol):
    """Checks that a line can run on the model it names (``served_models.ModelSet``)."""

    def check_line(self, url: str, body: Body) -> object:
        """The model the line runs on (any object, compared by identity); InvalidRequest if it
        cannot run there."""
        ...


def _line_model(url: str, body: Body, served_models: Collection[str] | LineRouter | None) -> object:
    """The model a line of a readable body runs on (None without a ``LineRouter``); InvalidRequest
    when it cannot run there or names a model not served."""
    if isinstance(served_models, LineRouter):
        try:
            return served_models.check_line(url, body)
        except InvalidRequest as exc:
            if url != RESPONSES:
                raise
            raise InvalidRequest(responses_terms(exc.message), param=exc.param) from None
    if served_models is not None and body.model is not None and body.model not in served_models:
        raise InvalidRequest(
            f"'body.model' {body.model!r} is not served here; use one of {', '.join(map(repr, served_models))}",
            param="body.model",
        )
    return None


ModelProblems = Callable[[str, Body], tuple[object, list[InvalidRequest]]]


def _model_problems_of(served_models: Collection[str] | LineRouter | None) -> ModelProblems:
    """What gives the model a line of a readable body runs on (None without a ``LineRouter``) and
    every reason it cannot run there (a model not served; each field the model's backend does not
    run), each naming its field, in the words of the line's endpoint."""
    line_problems_of = getattr(served_models, "line_problems", None)
    if not isinstance(served_models, LineRouter) or line_problems_of is None:

        def checked(url: str, body: Body) -> tuple[object, list[InvalidRequest]]:
            try:
                return _line_model(url, body, served_models), []
            except InvalidRequest as exc:
                return None, [exc]

        return checked

    def of_router(url: str, body: Body) -> tuple[object, list[InvalidRequest]]:
        model, problems = line_problems_of(url, body)
        if problems and url == RESPONSES:
            problems = [_in_responses_terms(problem) for problem in problems]
        return model, problems

    return of_router


def _in_responses_terms(problem: InvalidRequest) -> InvalidRequest:
    param = None if problem.param is None else responses_terms(f"'{problem.param}'").strip("'")
    return InvalidRequest(responses_terms(problem.message), param=param)


def _body_field(param: str | None) -> str | None:
    """The body field a problem's ``param`` is in (``body.messages[0].role``: ``messages``), or
    None for a problem outside the body."""
    if param is None or not param.startswith("body."):
        return None
    return param.removeprefix("body.").split(".")[0].split("[")[0]


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
        line_number = 1
        for block in _blocks(stream, VALIDATION_BLOCK_BYTES):
            line_number += validation.check_block(line_number, block)
    return validation.summary()


def _blocks(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """The file in blocks of whole lines (about ``size`` bytes, or one longer line); only the last
    block may end without a newline."""
    carry = b""
    while chunk := stream.read(size):
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        if not cut:  # inside a line longer than a block
            carry = data
            continue
        block, carry = data[:cut], data[cut:]
        yield block
    if carry:
        yield carry


class _Validation:
    """What validation has found so far, block by block.

    A block whose bytes are valid UTF-8 and within the JSON bounds (``lines_within_bounds``) is
    first checked at once, once the first request line has set the file's endpoint: every line
    decoded by the endpoint's ``BlockReader``, the lines grouped by shape, each shape judged once
    per file (one of its lines checked the per-line way, below), and the block's ``custom_id``
    values checked for duplicates as one set. The whole block is accepted that way or not at all.

    Otherwise each line is checked the per-line way: decoded whole with one decoder
    (``line_decoder``) and its remaining rules checked on the result (with a ``LineRouter``, its
    ``check_line`` too, and the model it gives must be the file's). A line that fails any of that,
    every line of an endpoint with no whole-line decoder, and every line of a block that is not
    valid UTF-8 or within the bounds, is checked the exact way (``check_line``), which says what
    is wrong. Each way accepts exactly the lines the exact way accepts.
    """

    def __init__(self, served_models: Collection[str] | LineRouter | None) -> None:
        self.served_models = served_models
        self.model_problems = _model_problems_of(served_models)
        self.router: LineRouter | None = None
        self.served_names: Collection[str] | None = None
        if isinstance(served_models, LineRouter):
            self.router = served_models
        else:
            self.served_names = served_models
        self.problems: list[LineProblem] = []
        self.total_problems = 0
        self.reported_lines = 0
        self.seen_ids: set[str] = set()
        self.file_url: str | None = None
        self.file_model: object = None
        self.count = 0
        #: Whether a line of each body shape (``BlockReader``; or its JSON) is accepted, for this
        #: file's url.
        self.shape_verdicts: dict[object, bool] = {}

    def summary(self) -> BatchFileSummary:
        """What the whole file's validation found: its summary, else InvalidBatchFile with the
        problems (or that the file holds no request)."""
        if self.count == 0:
            raise InvalidBatchFile([LineProblem(1, "the file contains no requests")])
        if self.problems:
            raise InvalidBatchFile(self.problems, self.total_problems)
        assert self.file_url is not None
        return BatchFileSummary(line_count=self.count, url=self.file_url)

    def report(self, line_number: int, messages: list[str]) -> None:
        """Record the problems of one line: every one of them counts; those of the first
        ``MAX_REPORTED_LINES`` lines with problems are listed, at most ``MAX_LINE_PROBLEMS`` each
        (the last one listed saying how many more the line has)."""
        self.total_problems += len(messages)
        if self.reported_lines >= MAX_REPORTED_LINES:
            return
        self.reported_lines += 1
        shown = messages[:MAX_LINE_PROBLEMS]
        self.problems.extend(LineProblem(line_number, message) for message in shown[:-1])
        self.problems.append(LineProblem(line_number, shown[-1], left_out=len(messages) - len(shown)))

    def check_block(self, first_line_number: int, block: bytes) -> int:
        """Check the lines of ``block``, the first numbered ``first_line_number``; how many lines
        it holds (the next block's first line number is that much later)."""
        lines = block.split(b"\n")
        if not lines[-1]:
            lines.pop()  # the block ends with a newline
        if not (_valid_utf8(block) and lines_within_bounds(block)):
            for line_number, raw in enumerate(lines, start=first_line_number):
                self.check_line(line_number, raw)
            return len(lines)
        start = 0
        while start < len(lines) and self.file_url is None:  # the first request line sets it
            self.check_line(first_line_number + start, lines[start])
            start += 1
        at_once = True
        for offset in range(start, len(lines), AT_ONCE_LINES):
            group = lines[offset : offset + AT_ONCE_LINES]
            if at_once:
                accepted = self.accept_at_once(group)
                if accepted:
                    continue
                at_once = accepted is not None  # None: the rest of the block goes line by line
            self.check_each(first_line_number + offset, group)
        return len(lines)

    def check_each(self, first_line_number: int, lines: list[bytes]) -> None:
        """Check lines (valid UTF-8, within the bounds, after the file's first request line) the
        per-line way, and those it does not accept the exact way."""
        url = self.file_url
        assert url is not None
        decoder = line_decoder(url)
        served, router, seen = self.served_names, self.router, self.seen_ids
        for line_number, raw in enumerate(lines, start=first_line_number):
            if decoder is None:
                self.check_line(line_number, raw)
                continue
            try:
                line = decoder.decode(raw)
                accepted = line.custom_id not in seen and self.accepts(line, url, served, router)
            except (msgspec.MsgspecError, InvalidRequest):
                accepted = False
            if accepted:
                self.count += 1
                seen.add(line.custom_id)
            else:  # blank, or wrong somewhere: the exact way says which
                self.check_line(line_number, raw)

    def accepts(self, line: Any, url: str, served: Collection[str] | None, router: LineRouter | None) -> bool:
        """Whether a line ``line_decoder(url)`` decoded passes every rule but the duplicate
        ``custom_id`` one; InvalidRequest (from ``check_body`` or the router) also means no."""
        return (
            bool(line.custom_id)
            and line.method == "POST"
            and line.url == url
            and check_body(line.body) is not None
            and (served is None or line.body.model is None or line.body.model in served)
            and (router is None or router.check_line(url, line.body) is self.file_model)
        )

    def accept_at_once(self, lines: list[bytes]) -> bool | None:
        """Accept every line of ``lines`` (valid UTF-8, within the bounds, after the file's first
        request line) and return True, or change nothing and return False when any line may not
        be acceptable, or None when more than ``MAX_NEW_SHAPES`` of their shapes are new (lines
        that differ in a field such as ``seed`` are checked faster one by one)."""
        url = self.file_url
        assert url is not None
        reader = block_reader(url)
        if reader is None:
            return False
        try:
            decoded = list(map(reader.decoder.decode, lines))
        except msgspec.MsgspecError:
            return False
        try:
            one_per_shape: dict[object, bytes] = dict(zip(reader.shapes(decoded), lines, strict=True))
        except TypeError:  # a shape holds a list or an object: tell shapes apart by their JSON
            one_per_shape = dict(zip(map(_JSON, reader.shapes(decoded)), lines, strict=True))
        verdicts = self.shape_verdicts
        new = sum(shape not in verdicts for shape in one_per_shape)
        if new > MAX_NEW_SHAPES or len(verdicts) + new > MAX_SHAPES:
            return None
        for shape, raw in one_per_shape.items():
            verdict = verdicts.get(shape)
            if verdict is None:
                verdict = verdicts[shape] = self.shape_accepted(url, raw)
            if not verdict:
                return False
        ids = set(map(_CUSTOM_ID, decoded))
        if len(ids) != len(decoded) or not self.seen_ids.isdisjoint(ids):
            return False
        self.seen_ids |= ids
        self.count += len(decoded)
        return True

    def shape_accepted(self, url: str, raw: bytes) -> bool:
        """Whether the line ``raw`` (which the block reader decoded), and so every line of its
        shape, passes the per-line way's rules."""
        decoder = line_decoder(url)
        assert decoder is not None  # an endpoint with a block reader has a line decoder
        try:
            return self.accepts(decoder.decode(raw), url, self.served_names, self.router)
        except (msgspec.MsgspecError, InvalidRequest):
            return False

    def check_line(self, line_number: int, raw: bytes) -> None:
        """Check one line the exact way, reporting every problem of it."""
        if not raw.strip():
            return
        self.count += 1
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            self.report(line_number, ["not valid UTF-8"])
            return
        reading = line_problems(raw)
        later: list[InvalidRequest] = []  # the problems of the checks after the request schema's
        model: object = None
        body = reading.body
        if body is not None and reading.url is not None:
            said = {_body_field(problem.param) for problem in reading.problems}
            if "model" not in said:  # a model field that is wrong is said already
                model, of_model = self.model_problems(reading.url, body)
                later.extend(problem for problem in of_model if _body_field(problem.param) not in said)
        if not reading.problems and not later:
            if self.file_model is None:
                self.file_model = model
            elif model is not self.file_model:
                assert body is not None
                later.append(
                    InvalidRequest(
                        f"'body.model' {body.model!r} is another model than the lines before; "
                        "a batch file's lines must all use one model (as in OpenAI's Batch API)",
                        param="body.model",
                    )
                )
        custom_id = reading.custom_id
        if custom_id is not None and custom_id in self.seen_ids:
            later.append(InvalidRequest(f"duplicate custom_id {custom_id!r}", param="custom_id"))
        if reading.url is not None and self.file_url is not None and reading.url != self.file_url:
            later.append(
                InvalidRequest(
                    f"'url' {reading.url!r} differs from {self.file_url!r}; a file must use one url",
                    param="url",
                )
            )
        if reading.problems or later:
            problems = in_field_order(raw, (*reading.problems, *later)) if later else reading.problems
            self.report(line_number, [problem.message for problem in problems])
            if custom_id is not None:  # a later line with this id is a duplicate all the same
                self.seen_ids.add(custom_id)
            return
        assert custom_id is not None
        self.seen_ids.add(custom_id)
        if self.file_url is None:
            self.file_url = reading.url


_CUSTOM_ID = operator.attrgetter("custom_id")
#: A shape's JSON: equal only for shapes of equal values of the same JSON types (1, 1.0 and true
#: differ), so equally acceptable.
_JSON = msgspec.json.Encoder().encode


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


def index_batch_file(path: str, with_prefixes: bool = True) -> LineIndex:
    """Record the offset, length and (``with_prefixes``) prompt prefix key of every non-blank line
    of the file at ``path``. A line with no key (embeddings) gets a key of its own (its negated
    position, a group of one), and a file with no keyed line records no keys at all."""
    if not with_prefixes:
        return _index_without_keys(path)
    offsets = array("q")
    lengths = array("l")
    prefixes = array("q")
    keyed = False
    position = 0
    with open(path, "rb") as stream:
        for raw in stream:
            if raw.strip():
                key = line_prefix_key(raw)
                if key is None:
                    key = -1 - len(offsets)
                else:
                    keyed = True
                offsets.append(position)
                lengths.append(len(raw))
                prefixes.append(key)
            position += len(raw)
    return LineIndex(offsets, lengths, prefixes if keyed else None)


def _index_without_keys(path: str) -> LineIndex:
    offsets = array("q")
    lengths = array("l")
    position = 0
    with open(path, "rb") as stream:
        for raw in stream:
            if raw.strip():
                offsets.append(position)
                lengths.append(len(raw))
            position += len(raw)
    return LineIndex(offsets, lengths, None)
