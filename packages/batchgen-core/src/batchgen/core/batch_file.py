"""The batch input file format: validating an uploaded JSONL file and indexing its lines.

Validation reads the file once, line by line, and reports the first problems by 1-based line
number. Indexing records where each request line starts and how long it is, so the intake pool can
queue requests as (offset, length) pairs and read a body only when its request is admitted.
Blank lines are ignored by both.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection
from typing import Any

import attrs
import msgspec

from batchgen.core.errors import InvalidBatchFile, LineProblem
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, SUPPORTED_ENDPOINTS

#: How many problems a validation error lists before summarising the rest.
MAX_REPORTED_PROBLEMS = 10

_decode = msgspec.json.Decoder().decode


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


def _problem_in_request(obj: Any, served_models: Collection[str] | None = None) -> str | None:
    """Return what is wrong with one decoded request line, or None when it is well formed."""
    if not isinstance(obj, dict):
        return "a line must be a JSON object"
    custom_id = obj.get("custom_id")
    if custom_id is None:
        return "missing 'custom_id'"
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    method = obj.get("method")
    if method != "POST":
        return f"'method' must be \"POST\", got {method!r}"
    url = obj.get("url")
    if url not in SUPPORTED_ENDPOINTS:
        return f"'url' must be one of {', '.join(SUPPORTED_ENDPOINTS)}, got {url!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    model = body.get("model")
    if served_models is not None and model is not None and model not in served_models:
        return f"'body.model' {model!r} is not served here; use one of {', '.join(map(repr, served_models))}"
    if body.get("stream") not in (None, False):
        return "'body.stream' must be false or absent: batches do not stream (streaming_unsupported)"
    if url == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'body.messages' must be a non-empty list for /v1/chat/completions"
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return "each message in 'body.messages' must be an object with a string 'role'"
    elif url == COMPLETIONS and not isinstance(body.get("prompt"), str):
        return "'body.prompt' must be a string for /v1/completions"
    return None


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
                obj = _decode(raw)
            except msgspec.DecodeError as exc:
                report(line_number, f"not valid JSON ({exc})")
                continue
            problem = _problem_in_request(obj, served_models)
            if problem is not None:
                report(line_number, problem)
                continue
            custom_id = obj["custom_id"]
            if custom_id in seen_ids:
                report(line_number, f"duplicate custom_id {custom_id!r}")
                continue
            seen_ids.add(custom_id)
            if file_url is None:
                file_url = obj["url"]
            elif obj["url"] != file_url:
                report(
                    line_number,
                    f"'url' {obj['url']!r} differs from {file_url!r}; a file must use one url",
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
